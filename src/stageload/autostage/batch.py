"""Stage-major batches on an :func:`~stageload.auto` session: ``session.map(fn, items)``.

Every ``fn(item)`` runs as a call of a :class:`~stageload.core.batch.Batch`; a call that
is about to use a model of a stage other than the batch's current one parks, so each
stage's models load once for all the items rather than once per item when the budget
holds one stage at a time.

Where a call parks: at the top of the model's call hook (``_Hook.pre_call``, before
:meth:`AutoSession.used`), so before the session's lock is taken and before the load and
the room it makes. A call nested in another model call (a part of the model, or a model
that another one calls) never parks: the outer model would stay in its call, unreleasable,
while the others run.

Stages: a plan source's seeded plan (diffusers' offload order, Pixal3D's stages) where
the session has one; else one stage per model, named after it, in the recorded plan's
order, then the session's other models in the order they were made, then any model first
used in the batch, as it is first seen. A caller that knows its stages (an adapter's own
boundaries, e.g. Pixal3D's) passes them and marks each with :meth:`StageMajor.mark`;
model calls then never park. With ``listed`` its stages are hard: entering one releases
what it does not use (:meth:`AutoSession.release_unlisted`).

Threads: :meth:`StageMajor.map` runs on the thread that called it, the batch's scheduler,
which alone enters stages (:meth:`StageMajor.enter`); each item runs on a thread of its
own, one at a time, and parks in :meth:`StageMajor.park_for` or :meth:`StageMajor.mark`.
Loads and releases run on the item's thread, as without a batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core.batch import Batch, current_batch
from ..core.events import REASON_CLOSE, STAGE, Event
from ..hooks.registry import in_call

if TYPE_CHECKING:
    from torch import nn

    from . import AutoSession

# Checks and sets a session's running batch in one step.
_LOCK = threading.Lock()


class StageMajor:
    """The stages of an auto session as a stage-major batch needs them (a
    :class:`~stageload.core.batch.BatchHost`), and :meth:`map`, which runs one.

    ``stages``: the caller's own stages (name -> what each uses), in order, marked by
    :meth:`mark`; None: stages by model, entered where a model is about to be called.
    ``emit``: where a marked stage's ``stage`` event goes (auto emits its own otherwise).
    ``listed``: hard stages, the objects each stage uses now (see :meth:`enter`).
    """

    def __init__(
        self,
        session: AutoSession,
        stages: Mapping[str, Iterable[str]] | None = None,
        *,
        emit: Callable[[Event], None] | None = None,
        listed: Callable[[], Mapping[str, Sequence[Any]]] | None = None,
    ) -> None:
        self.session = session
        self.marked = stages is not None
        self._stages: dict[str, tuple[str, ...]] = {
            name: tuple(uses) for name, uses in (stages or {}).items()
        }
        self.stage: str | None = None
        self._emit = emit if emit is not None else session._emit
        self._listed = listed
        self._batch: Batch | None = None

    # -- BatchHost -----------------------------------------------------------------------
    @property
    def stages(self) -> Mapping[str, tuple[str, ...]]:
        """The stages in order; by model, it grows as the batch meets new models."""
        return self._stages

    def emit(self, event: Event) -> None:
        self._emit(event)

    def resident(self) -> dict[str, nn.Module]:
        """The models auto has loaded now (the batch's note counts what else is held)."""
        models = self.session.models
        return {n: m for n in self.session.resident() if (m := models.get(n)) is not None}

    def enter(self, stage: str) -> None:
        """Mark ``stage`` begun (by the batch's scheduler, or :meth:`mark`); again: nothing.
        Marked stages emit a ``stage`` event; hard ones release every model the stage does
        not use, but for one that a later stage lists and nothing has called yet (made
        loaded before its stage, it would be read again there)."""
        if stage == self.stage:
            return
        self.stage = stage
        if self.marked:
            self._emit(Event(STAGE, stage=stage))
        if self._listed is not None:
            by_stage = list(self._listed().items())
            at = next((i for i, (name, _) in enumerate(by_stage) if name == stage), None)
            later = [] if at is None else by_stage[at + 1 :]
            self.session.release_unlisted(
                dict(by_stage).get(stage, []), later=[o for _, objs in later for o in objs]
            )

    # -- the calls' side -----------------------------------------------------------------
    def mark(self, stage: str) -> None:
        """A caller's stage boundary: in a batch, wait until the batch is in ``stage``."""
        batch = self._batch
        if batch is not None:
            batch.park(stage)
        self.enter(stage)

    def park_for(self, name: str) -> None:
        """The model ``name`` is about to be called (its hook, before any lock): a call of
        the batch parks until the batch is in that model's stage. Stages by model only."""
        batch = self._batch
        if batch is None or self.marked or current_batch() is not batch or in_call():
            return
        mutex = self.session._mutex
        if getattr(mutex, "_is_owned", lambda: False)():  # parked under it, all would hang
            return
        if name in self._stages.get(self.stage or "", ()):
            return
        batch.park(self._stage_of(name))

    def _stage_of(self, name: str) -> str:
        """The stage of model ``name``: its first at or after the current one, else its
        first; a model no stage lists gets its own, last (run by one call at a time)."""
        order = list(self._stages)
        at = order.index(self.stage) if self.stage in self._stages else 0
        found = [s for s in order if name in self._stages[s]]
        if not found:
            self._stages[name] = (name,)
            return name
        return next((s for s in found if order.index(s) >= at), found[0])

    # -- running a batch -----------------------------------------------------------------
    def map(
        self, fn: Callable[[Any], Any], items: Iterable[Any], *, return_exceptions: bool = False
    ) -> list[Any]:
        """``fn(item)`` for every item, stage-major; results in item order. A call that
        raised: :class:`~stageload.core.batch.BatchError` once all are done, or, with
        ``return_exceptions``, its exception in its slot. One batch at a time per session."""
        if not self.marked:
            self._stages = self._planned()
            self.stage = None  # the first use of each call parks: every item starts together
        batch = Batch(self, fn, items)
        session = self.session
        try:  # set inside: a Ctrl-C just after it left the session counting a batch for good
            with _LOCK:  # checked and set in one step: two threads' batches never both run
                if session.batch is not None:
                    raise RuntimeError(
                        "one batch at a time on an auto session: map() is running on another "
                        "thread; call it again once that one returns"
                    )
                session.batch, self._batch = self, batch
            return batch.run(return_exceptions=return_exceptions)
        finally:
            if self._batch is batch:
                session.batch, self._batch = None, None

    def _planned(self) -> dict[str, tuple[str, ...]]:
        """Stages by model, before the batch: the seeded plan's, or one per model in the
        recorded plan's order, then the session's other models as they were made."""
        session = self.session
        with session._mutex:
            plan, seeded = session.record.plan, session.record.seeded
            stages = dict(plan.items()) if plan is not None and seeded else {}
            names = [n for s in plan.values() for n in s] if plan is not None else []
            names += list(session._models)
        listed = {n for uses in stages.values() for n in uses}
        for name in names:
            if name not in listed:
                listed.add(name)
                stages[name] = (name,)
        return stages

    def close(self) -> None:
        """Release every model the session holds (reason ``close``): a run's end, as the
        staged build's close; the block's end alone leaves them loaded."""
        self.session.release_unlisted((), reason=REASON_CLOSE)
