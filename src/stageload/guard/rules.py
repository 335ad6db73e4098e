"""The two rules of the machine-wide queue: whose turn it is (fairness between owners) and
whether the command whose turn it is fits beside those running (memory).

Both are pure functions of the lane's tickets and the readings, so ``stageload run`` (which
acts on them) and ``stageload queue`` (which shows them) decide alike. docs/queue.md states
them in words.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..units import format_size
from .queue import Ticket

Why = Literal["ready", "turn", "memory", "busy"]


def fair_order(waiting: Sequence[Ticket], last_start: Mapping[str, float]) -> list[Ticket]:
    """The order in which ``waiting`` tickets get their turn.

    Repeatedly: of the owners with a waiting ticket, the one whose latest start is the
    oldest goes next (an owner who never started counts as oldest; ties go to the owner
    whose next ticket is older), with that owner's oldest waiting ticket; that owner then
    counts as having started just now. So each owner's commands keep their order, and
    owners take turns.
    """
    queues: dict[str, deque[Ticket]] = {}
    for ticket in sorted(waiting, key=lambda t: t.seq):
        queues.setdefault(ticket.owner, deque()).append(ticket)
    # (rank, time): never started < started at a real time < picked earlier in this order.
    key: dict[str, tuple[int, float]] = {
        owner: (1, last_start[owner]) if owner in last_start else (0, 0.0) for owner in queues
    }
    order: list[Ticket] = []
    picked = 0
    while queues:
        owner = min(queues, key=lambda o: (key[o], queues[o][0].seq))
        order.append(queues[owner].popleft())
        if not queues[owner]:
            del queues[owner]
        picked += 1
        key[owner] = (2, float(picked))
    return order


@dataclass
class Running:
    """A ticket that holds a place in its lane, with the memory its command uses now."""

    ticket: Ticket
    use: int | None  # footprint of the command's process tree; None before it starts

    @property
    def reserved(self) -> int:
        """What it may still take of its need: ``max(0, need - use)`` (use unknown: 0)."""
        need = self.ticket.need or 0
        return max(0, need - (self.use or 0))


@dataclass
class Decision:
    """Whether the head of a lane may start now, and if not why (``busy``/``memory``)."""

    ok: bool
    why: Why
    detail: str
    room: int | None = None  # available - reserved, when computed
    numbers: dict[str, Any] = field(default_factory=dict)


def decide(need: int | None, running: Sequence[Running], available: int | None) -> Decision:
    """The memory rule, for the ticket whose turn it is (docs/queue.md states it).

    - Nothing runs in the lane: it starts.
    - A running command whose need is unknown runs alone: it waits (``busy``).
    - Its own need is unknown: it runs alone, so it waits for the lane to empty (``busy``).
    - Otherwise it starts when ``need <= available - sum(max(0, need_r - use_r))`` over the
      running commands r, where ``available`` is what the memory readers report now (it
      already excludes what the running commands use) and ``use_r`` is r's footprint now;
      else it waits (``memory``). Available memory unreadable: it waits (``memory``).
    """
    if not running:
        return Decision(True, "ready", "the lane is empty")
    alone = [r for r in running if r.ticket.need is None]
    if alone:
        t = alone[0].ticket
        return Decision(
            False, "busy", f"{t.owner}'s {_short(t.command)!r} runs alone (need unknown)"
        )
    if need is None:
        return Decision(
            False,
            "busy",
            f"never run before in this lane: runs alone, after the {len(running)} running",
        )
    if available is None:
        return Decision(False, "memory", "available memory unreadable: waits for an empty lane")
    reserved = sum(r.reserved for r in running)
    room = available - reserved
    numbers = {"available": available, "reserved": reserved, "room": room, "need": need}
    text = (
        f"need {format_size(need)} vs room {format_size(room)} = available "
        f"{format_size(available)} - {format_size(reserved)} still reserved by "
        f"{len(running)} running"
    )
    if need <= room:
        return Decision(True, "ready", text, room, numbers)
    return Decision(False, "memory", text, room, numbers)


def _short(command: Sequence[str], width: int = 40) -> str:
    text = " ".join(command)
    return text if len(text) <= width else text[: width - 3] + "..."


def running_view(tickets: Sequence[Ticket]) -> list[Running]:
    """The lane's admitted and running tickets with their commands' footprints now."""
    from ..memory import read_process

    found = []
    for t in tickets:
        if t.state == "waiting":
            continue
        use = None
        if t.pid is not None:
            use = read_process(t.pid, tree=True).footprint
        found.append(Running(t, use))
    return found


def finite(x: float | None) -> float | None:
    """``x`` rounded for JSON, None if missing or not finite."""
    return None if x is None or not math.isfinite(x) else round(x, 3)
