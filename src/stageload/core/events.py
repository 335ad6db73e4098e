"""The Event record that StagedModels emits, and the sink protocol that receives it."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

#: The name of the time before the first stage is entered.
SETUP = "setup"

#: Event kinds emitted by the core. The guard adds ``guard``; users may add their own.
LOAD = "load"
RELOAD = "reload"
RELEASE = "release"
STAGE = "stage"
NOTE = "note"
#: A load run ahead of need in a background thread (``StagedModels(prefetch=...)``), so it
#: overlaps the current stage's compute; ``note`` names the stage it is for.
PREFETCH = "prefetch"
#: One block of a streamed model (``stageload.streamed``) read from its checkpoint, used and
#: released: ``model`` is the streamed model's name, ``note`` the block's path, ``bytes`` and
#: ``seconds`` the read, ``compute`` the seconds its calls computed with it.
BLOCK = "block"

#: Why a model was released: the ``reason`` of a ``release`` event.
REASON_NOT_IN_PLAN = "not in plan"  # the entered stage does not list it (no stage, under a budget)
REASON_BUDGET = "budget"  # evicted to fit the memory budget: its next use is furthest away
REASON_EVICT = "evict"  # models.evict(name)
REASON_CLOSE = "close"  # models.close()


@dataclass(frozen=True)
class Event:
    """One thing that happened to the models: a load, reload, prefetch, release, stage change
    or note.

    ``reason`` says why a ``release`` happened (``REASON_*`` above). ``time`` is
    ``time.monotonic()`` when the event finished; a sink that writes a trace turns it into
    seconds since its own start. ``seconds`` is how long the action took.
    """

    kind: str
    model: str | None = None
    stage: str | None = None
    bytes: int | None = None
    seconds: float | None = None
    note: str | None = None
    reason: str | None = None
    #: Seconds of compute a ``block`` event's block served (the other kinds leave it unset).
    compute: float | None = None
    time: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict[str, Any]:
        """The event as a plain dict, without fields that are ``None``."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@runtime_checkable
class EventSink(Protocol):
    """Anything with ``emit(event)``: a list for tests, a MemoryMeter, a logger."""

    def emit(self, event: Event) -> None: ...


class ListSink:
    """Collects events in ``self.events``; handy in tests and notebooks."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def kinds(self, kind: str) -> list[Event]:
        """The events of one kind, in order."""
        return [e for e in self.events if e.kind == kind]

    def __repr__(self) -> str:
        return f"ListSink({len(self.events)} events)"


class TeeSink:
    """Sends each event to several sinks, e.g. a meter and a ListSink."""

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            sink.emit(event)
