"""The queue's history: one JSON line per finished run of a lane, and the need learned from it.

Each line is written with one ``os.write`` on a file opened with ``O_APPEND``, so clients
finishing at the same moment never mix their lines; a line that cannot be parsed (a disk
that filled up mid-line) is skipped when reading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: The history file in each lane's folder.
HISTORY_FILE = "history.jsonl"
#: The learned need is the highest peak footprint among this many latest runs of a command.
LEARN_RUNS = 5
#: The keys of a history record, in the order they are written (docs/queue.md).
RECORD_KEYS = (
    "command",
    "owner",
    "lane",
    "start",
    "wait",
    "duration",
    "peak_footprint",
    "swap_growth",
    "exit_code",
    "outcome",
    "need",
    "need_source",
    "trace",
)


def append_record(path: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """Append ``record`` to the history at ``path`` as one line."""
    line = json.dumps(dict(record), separators=(",", ":"), default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_records(path: str | os.PathLike[str], last: int | None = None) -> list[dict[str, Any]]:
    """The history's records, oldest first (only the ``last`` ones if given); [] if none."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    except OSError as exc:  # a folder in its place, no permission: say which file
        from .queue import QueueSetupError

        raise QueueSetupError(
            f"cannot read the history {str(path)!r}: {exc.strerror or exc}; move it away "
            "(a new one starts with the next run)"
        ) from None
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn line: skip it, keep the rest
        if isinstance(record, dict):
            records.append(record)
    if last is not None:
        records = records[-last:] if last > 0 else []
    return records


def learned_need(records: Sequence[Mapping[str, Any]], command: Sequence[str]) -> int | None:
    """The highest peak footprint among the latest ``LEARN_RUNS`` runs of exactly ``command``
    (the same argv) that recorded one above 0; None when there is none (it runs alone).

    The highest rather than the latest, because one run's peak varies with its input and a
    need that is too low lets a neighbour start into memory this command will take.
    """
    argv = list(command)
    peaks = [
        r["peak_footprint"]
        for r in records
        if r.get("command") == argv
        # 0 is no reading: a command that ended before its first sample (a zombie holds 0)
        and isinstance(r.get("peak_footprint"), int)
        and r["peak_footprint"] > 0
    ]
    recent = peaks[-LEARN_RUNS:]
    return max(recent) if recent else None
