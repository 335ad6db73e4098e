"""The queue's history: one JSON line per finished run of a lane, and the need learned from it.

Each line is written with one ``os.write`` on a file opened with ``O_APPEND``, so clients
finishing at the same moment never mix their lines. A line is data, not a code path: one
that cannot be parsed (a disk that filled up mid-line), or whose values are out of range (a
peak of 400 digits or ``"x"``, a start of 1e300, a need above ``SIZE_MAX``), is skipped and
counted when reading (``History.skipped``), never shown as a figure and never learned from.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from ..units import DURATION_MAX, SIZE_MAX
from .queue import QueueSetupError, is_int, is_number, is_wall_time, parse_json

#: The history file in each lane's folder.
HISTORY_FILE = "history.jsonl"
#: The learned need is the highest peak footprint among this many latest runs of a command.
LEARN_RUNS = 5
#: The keys of a history record, in the order they are written (docs/queue.md).
RECORD_KEYS = (
    "command",
    "owner",
    "who",
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


@dataclass
class History:
    """A lane's history as read: the records in range, oldest first, and how many lines
    were skipped as damaged."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


def check_record(record: object, now: float | None = None) -> TypeGuard[dict[str, Any]]:
    """Whether ``record`` is a history record whose values are in range: each key is absent,
    null, or of its type and range (sizes 0..SIZE_MAX bytes, seconds within DURATION_MAX,
    ``start`` a wall time up to a day from now, ``exit_code`` 0..255). Lines of earlier
    versions lack ``who``: that is fine."""
    if not isinstance(record, dict):
        return False
    now = time.time() if now is None else now

    def text(value: object) -> bool:
        return isinstance(value, str)

    checks = {
        "command": lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
        "owner": text,
        "who": text,
        "lane": text,
        "start": lambda v: is_wall_time(v, now),
        "wait": lambda v: is_number(v, -DURATION_MAX, DURATION_MAX),  # a clock step: < 0
        "duration": lambda v: is_number(v, 0.0, DURATION_MAX),
        "peak_footprint": lambda v: is_int(v, 0, SIZE_MAX),
        "swap_growth": lambda v: is_int(v, -SIZE_MAX, SIZE_MAX),  # swap may shrink
        "exit_code": lambda v: is_int(v, 0, 255),
        "outcome": text,
        "need": lambda v: is_int(v, 0, SIZE_MAX),
        "need_source": lambda v: v in ("declared", "learned", "unknown"),
        "trace": text,
    }
    return all(record.get(key) is None or ok(record[key]) for key, ok in checks.items())


def read_history(path: str | os.PathLike[str], last: int | None = None) -> History:
    """The history at ``path``: its records in range, oldest first (only the ``last`` ones
    if given), and the count of lines skipped (torn, not JSON objects, out of range)."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return History()
    except OSError as exc:  # a folder in its place, no permission: say which file
        raise QueueSetupError(
            f"cannot read the history {str(path)!r}: {exc.strerror or exc}; move it away "
            "(a new one starts with the next run)"
        ) from None
    history = History()
    now = time.time()
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = parse_json(line)
        except ValueError:
            record = None  # a torn line: skip it, keep the rest
        if check_record(record, now):
            history.records.append(record)
        else:
            history.skipped += 1
    if last is not None:
        history.records = history.records[-last:] if last > 0 else []
    return history


def read_records(path: str | os.PathLike[str], last: int | None = None) -> list[dict[str, Any]]:
    """The records of ``read_history`` alone."""
    return read_history(path, last).records


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
