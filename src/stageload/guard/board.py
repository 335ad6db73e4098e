"""What ``stageload queue`` shows: each lane's running and waiting commands, and its history.

``snapshot`` reads the lanes under their locks (removing tickets of dead clients on the way,
as every reader does) and decides, with the same rules as the clients, why each waiting
command waits. ``format_text`` turns the snapshot into the table printed without ``--json``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..text import printable
from ..units import format_duration, format_size
from .history import read_history
from .queue import Lane, QueueSetupError, _folder_error, list_lanes, state_dir
from .rules import decide, fair_order, finite, running_view


def lane_snapshot(lane: Lane, history: int = 0) -> dict[str, Any]:
    """One lane: ``running`` and ``waiting`` entries, available memory, ``history``, and
    ``skipped``: what its reads skipped as damaged, by kind (``Lane.skipped``)."""
    from ..memory import read_system

    now = time.time()
    system = read_system()
    running: list[dict[str, Any]] = []
    waiting: list[dict[str, Any]] = []
    if os.path.lexists(lane.dir) and not lane.dir.is_dir():  # listed, but a file
        raise QueueSetupError(_folder_error(lane.home, lane.dir, NotADirectoryError(20, "")))
    if lane.dir.is_dir():
        with lane.locked():
            tickets = lane.tickets()
            order = fair_order([t for t in tickets if t.state == "waiting"], lane.owner_starts())
        views = running_view(tickets)
        for view in views:
            t = view.ticket
            since = t.started if t.started is not None else t.admitted
            running.append(
                {
                    "owner": t.owner,
                    "command": t.command,
                    # "admitted": its guard still waits for room; "orphaned": its client
                    # died, the command runs on unguarded (its need still counts)
                    "state": "orphaned" if t.orphaned else t.state,
                    "since": finite(since),
                    "seconds": finite(None if since is None else now - since),
                    "pid": t.pid,
                    "client_pid": t.client_pid,
                    "memory_now": view.use,
                    "need": t.need,
                    "need_source": t.need_source,
                }
            )
        for position, t in enumerate(order, start=1):
            if position == 1:
                decision = decide(t.need, views, system.available)
                why, detail = decision.why, decision.detail
            else:
                why, detail = "turn", f"after {order[position - 2].owner}"
            waiting.append(
                {
                    "position": position,
                    "owner": t.owner,
                    "command": t.command,
                    "since": finite(t.enqueued),
                    "seconds": finite(now - t.enqueued),
                    "client_pid": t.client_pid,
                    "need": t.need,
                    "need_source": t.need_source,
                    "why": why,
                    "detail": detail,
                }
            )
    records = []
    if history:
        read = read_history(lane.history_path, last=history)
        records, lane.skipped["history"] = read.records, read.skipped
    return {
        "lane": lane.name,
        "available": system.available,
        "available_source": system.sources.get("available"),
        "running": running,
        "waiting": waiting,
        "history": records,
        "skipped": {k: n for k, n in sorted(lane.skipped.items()) if n},
    }


def snapshot(
    home: str | os.PathLike[str] | None = None, lane: str | None = None, history: int = 0
) -> dict[str, Any]:
    """The whole document ``stageload queue --json`` prints: one entry per lane (all lanes
    that exist, or just ``lane``)."""
    root = state_dir(home)
    try:
        if not root.stat().st_mode & 0o040000:  # S_IFDIR
            raise NotADirectoryError(20, "Not a directory")
    except FileNotFoundError:
        pass  # nothing queued yet: empty lanes
    except OSError as exc:
        raise QueueSetupError(_folder_error(root, root, exc)) from None
    names = [lane] if lane is not None else list_lanes(home)
    return {
        "state_dir": str(state_dir(home)),
        "time": finite(time.time()),
        "lanes": [lane_snapshot(Lane(home, name), history) for name in names],
    }


def _need(entry: dict[str, Any]) -> str:
    if entry["need"] is None:
        return "need unknown (runs alone)"
    return f"need {format_size(entry['need'])} ({entry['need_source']})"


def _command(argv: list[str], width: int = 48) -> str:
    # Escaped: another user's command must not write a newline or a terminal escape here.
    text = printable(" ".join(map(str, argv)))
    return text if len(text) <= width else text[: width - 3] + "..."


def _text(value: Any) -> str:
    """A name from a ticket or a history line, shown escaped (``printable``)."""
    return printable(str(value))


def _clock(when: float | None) -> str:
    return "-" if when is None else time.strftime("%H:%M:%S", time.localtime(when))


def format_text(doc: dict[str, Any]) -> str:
    """The snapshot as the text ``stageload queue`` prints."""
    lines = []
    if not doc["lanes"]:
        return f"no lanes yet in {doc['state_dir']} (stageload run creates them)\n"
    for lane in doc["lanes"]:
        lines.append(
            f"lane {_text(lane['lane'])}: {len(lane['running'])} running, {len(lane['waiting'])} "
            f"waiting; available {format_size(lane['available'])}"
        )
        for r in lane["running"]:
            state = {
                "running": "running",
                "admitted": "admitted, guard waiting for room",
                "orphaned": "orphaned: client gone, still running unguarded",
            }[r["state"]]
            lines.append(
                f"  {state}  {_text(r['owner'])}  {_command(r['command'])}  "
                f"since {_clock(r['since'])} "
                f"({format_duration(r['seconds'])})  memory {format_size(r['memory_now'])} / "
                + _need(r)
            )
        for w in lane["waiting"]:
            lines.append(
                f"  #{w['position']} waiting ({w['why']})  {_text(w['owner'])}  "
                f"{_command(w['command'])}  since {_clock(w['since'])} "
                f"({format_duration(w['seconds'])})  {_need(w)}; "
                f"{_text(w['detail'])}"
            )
        if lane["skipped"]:
            what = ", ".join(f"{n} {kind}" for kind, n in lane["skipped"].items())
            lines.append(f"  skipped as damaged: {what}")
        if lane["history"]:
            n = len(lane["history"])
            lines.append("  last run:" if n == 1 else f"  last {n} runs:")
        for h in lane["history"]:
            start = h.get("start")
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)) if start else "-"
            who = h.get("who")
            owner = h.get("owner") if who in (None, h.get("owner")) else f"{h.get('owner')} ({who})"
            owner = _text(owner)
            lines.append(
                f"    {when}  {owner}  {_command(h.get('command') or [])}  "
                f"waited {format_duration(h.get('wait'))}, ran "
                f"{format_duration(h.get('duration'))}, peak "
                f"{format_size(h.get('peak_footprint'))}, exit {h.get('exit_code')}"
            )
    return "\n".join(lines) + "\n"
