"""Stage-major batches: N calls of one pipeline, each stage entered once for all of them.

``StagedModels.map(fn, items)`` runs every ``fn(item)`` in its own thread, but only one
of them at any moment: a baton (one ``Condition`` and a turn number) passes between the
calls and the scheduler, the thread that called ``map``. A call that enters a stage other
than the batch's current one parks there (inside ``enter``, before its lock). Once every
call has parked or finished, the scheduler enters the earliest stage, in plan order, that
a parked call waits for, once, and resumes the calls waiting for it one at a time, in
item order. The others stay parked.

Re-entry: a call that needs an earlier stage again (a negative-prompt pass, img2img's
VAE encode before the denoiser) parks like any other; "earliest in plan order" lets it
catch up before the rest move on, so the batch enters each stage as often as one call
would, never once per call, and nothing waits on anything but the scheduler.

Randomness belongs to the call: every call starts from the global RNG state at
``map()``'s entry, and the scheduler saves the running call's state and restores the
next one's at every switch (torch CPU/CUDA/MPS, ``random``, NumPy; see ``rng``).

Threads: the scheduler alone enters stages for the batch; a call only runs while it holds
the turn. Loads happen in whichever thread asks for the model (``models[name]``), under
the registry's own lock, which no parked call holds.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .events import NOTE, Event
from .rng import RngState, capture_rng, restore_rng
from .units import format_size

if TYPE_CHECKING:
    from .staged import StagedModels

_SCHEDULER = -1
# How deep the intermediates estimate looks into a local's containers and attributes.
_DEPTH = 3


class BatchError(RuntimeError):
    """Some calls of a :meth:`StagedModels.map` batch raised; every other call ran to its end.

    ``results`` holds each item's return value, or its exception; ``errors`` maps the
    index of each failed item to its exception. The first one is the ``__cause__``.
    """

    def __init__(self, results: list[Any], errors: dict[int, BaseException]) -> None:
        self.results = results
        self.errors = errors
        first = min(errors)
        exc = errors[first]
        super().__init__(
            f"{len(errors)} of {len(results)} calls of the batch raised (items "
            f"{sorted(errors)!r}); the first, item {first}: {type(exc).__name__}: {exc}. "
            f"The other results are in .results; map(..., return_exceptions=True) returns "
            f"them with each exception in its item's slot instead"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.results, self.errors))


class _Abandoned(BaseException):
    """Unwinds a parked call when the batch is given up (the scheduler was interrupted)."""


class _Call:
    __slots__ = ("index", "item", "thread", "want", "done", "result", "error", "rng")

    def __init__(self, index: int, item: Any, rng: RngState) -> None:
        self.index = index
        self.item = item
        self.thread: threading.Thread | None = None
        self.want: str | None = None  # the stage it is parked for
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.rng = rng


class Batch:
    """One run of :meth:`StagedModels.map`; ``StagedModels.enter`` calls :meth:`park`."""

    def __init__(self, models: StagedModels, fn: Callable[[Any], Any], items: Iterable[Any]):
        if not callable(fn):
            raise TypeError(f"map() takes the function to run first, got {fn!r}")
        self.models = models
        self._fn = fn
        self._items = list(items)
        self._order = {stage: k for k, stage in enumerate(models.stages)}
        self._cond = threading.Condition()
        self._turn = _SCHEDULER
        self._abandoned = False
        self._calls: list[_Call] = []
        self._by_thread: dict[int, _Call] = {}
        #: The stages this batch entered, in order.
        self.entered: list[str] = []

    # -- called from the calls' threads --------------------------------------------------
    def park(self, stage: str) -> None:
        """Wait until the batch is in ``stage``; returns at once outside the batch's calls."""
        call = self._by_thread.get(threading.get_ident())
        if call is None:
            return
        if self._abandoned:  # unwinding: a finally block must not park again
            raise _Abandoned
        if stage == self.models.stage:
            return
        call.want = stage
        self._hand_back(call)
        call.want = None

    def _hand_back(self, call: _Call) -> None:
        with self._cond:
            self._turn = _SCHEDULER
            self._cond.notify_all()
            while self._turn != call.index:
                self._cond.wait()
        if self._abandoned:
            raise _Abandoned

    def _body(self, call: _Call, context: contextvars.Context, modes: tuple[bool, bool]) -> None:
        import torch

        with self._cond:
            while self._turn != call.index:
                self._cond.wait()
        try:
            if self._abandoned:
                raise _Abandoned
            grad, inference = modes  # thread-local in torch: take the caller's
            mode = torch.inference_mode() if inference else torch.set_grad_enabled(grad)
            with mode:
                call.result = context.run(self._fn, call.item)
        except BaseException as exc:  # noqa: BLE001 (the scheduler decides what to raise)
            call.error = exc
        finally:
            call.done = True
            with self._cond:
                self._turn = _SCHEDULER
                self._cond.notify_all()

    # -- the scheduler (the thread that called map) --------------------------------------
    def run(self, *, return_exceptions: bool = False) -> list[Any]:
        import torch

        if self.models._batch is not None:
            raise RuntimeError(
                "map() is already running a batch on these models; a call of a batch "
                "cannot start another one on the same StagedModels"
            )
        if not self._items:
            return []
        entry = capture_rng()
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self._calls = [_Call(i, item, entry) for i, item in enumerate(self._items)]
        for call in self._calls:
            thread = threading.Thread(
                target=self._body,
                args=(call, contextvars.copy_context(), modes),
                name=f"stageload-map-{call.index}",
                daemon=True,  # a call stuck in native code must not keep the process alive
            )
            call.thread = thread
            thread.start()
            assert thread.ident is not None
            self._by_thread[thread.ident] = call
        self.models._batch = self
        try:
            for call in self._calls:  # setup: each call runs until its first stage change
                self._resume(call)
            while live := [c for c in self._calls if not c.done]:
                stage = min((c.want for c in live if c.want), key=self._order.__getitem__)
                self._enter(stage, live)
                for call in live:
                    if call.want == stage:
                        self._resume(call)
        except BaseException:
            self._abandon()
            raise
        finally:
            self.models._batch = None
        for call in self._calls:
            assert call.thread is not None
            call.thread.join()
        # As after running the calls in turn: the state the last call left.
        restore_rng(self._calls[-1].rng)
        results = [c.error if c.error is not None else c.result for c in self._calls]
        errors = {c.index: c.error for c in self._calls if c.error is not None}
        if errors and not return_exceptions:
            raise BatchError(results, errors) from errors[min(errors)]
        return results

    def _resume(self, call: _Call) -> None:
        """Give ``call`` the turn with its own RNG state; return when it parks or ends."""
        restore_rng(call.rng)
        with self._cond:
            self._turn = call.index
            self._cond.notify_all()
            while self._turn != _SCHEDULER:
                self._cond.wait()
        call.rng = capture_rng()

    def _enter(self, stage: str, live: list[_Call]) -> None:
        waiting = [c.index for c in live if c.want == stage]
        parked = len(live)
        held = intermediates(self._calls, self.models)
        self.models._emit(
            Event(
                NOTE,
                stage=stage,
                bytes=held,
                note=(
                    f"batch: entering {stage!r} for items {waiting!r}; {parked} parked "
                    f"calls and the finished results hold {format_size(held)} of tensors "
                    f"besides the loaded models"
                ),
            )
        )
        self.entered.append(stage)
        self.models.enter(stage)  # the scheduler is no call: this is the real enter

    def _abandon(self) -> None:
        """Unwind every unfinished call, one at a time, after the scheduler was interrupted."""
        self._abandoned = True
        with self._cond:
            while self._turn != _SCHEDULER:  # the running call parks or ends first
                self._cond.wait()
        for call in self._calls:
            if not call.done:
                with self._cond:
                    self._turn = call.index
                    self._cond.notify_all()
                    while self._turn != _SCHEDULER:
                        self._cond.wait()
        for call in self._calls:
            if call.thread is not None and call.done:
                call.thread.join()


def intermediates(calls: list[_Call], models: StagedModels) -> int:
    """Bytes of the distinct tensor storages the batch holds besides the loaded models.

    Counted: tensors reachable from the locals of parked calls' frames (into lists,
    tuples, dicts and plain objects' attributes, ``_DEPTH`` levels deep), and finished
    calls' results. Not counted: the loaded models' parameters and buffers, modules
    themselves, and memory that no Python object points to (allocator caches).
    """
    import torch
    from torch import nn

    weights: set[int] = set()
    for name in models.loaded():
        module = models._models.get(name)
        if module is not None:
            for tensor in [*module.parameters(), *module.buffers()]:
                if not tensor.is_meta:
                    weights.add(tensor.untyped_storage().data_ptr())
    seen: set[int] = set()
    storages: dict[int, int] = {}
    skip = (Batch, _Call, type(models), nn.Module, type, threading.Thread)

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_meta or obj.layout != torch.strided:
                return
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in weights:
                storages[ptr] = storage.nbytes()
            return
        if depth >= _DEPTH or isinstance(obj, skip) or callable(obj):
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for value in obj:
                visit(value, depth + 1)
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value, depth + 1)
        elif isinstance(getattr(obj, "__dict__", None), dict):
            for value in vars(obj).values():
                visit(value, depth + 1)

    frames = sys._current_frames()
    for call in calls:
        if call.done:
            visit(call.result, 0)
            continue
        frame = frames.get(call.thread.ident) if call.thread is not None else None
        while frame is not None:
            if frame.f_code.co_filename not in _NOT_CALLERS:
                for value in frame.f_locals.values():
                    visit(value, 0)
            frame = frame.f_back
    return sum(storages.values())


# The batch's and the registry's own frames, and the thread's start-up, hold none.
_NOT_CALLERS = frozenset({__file__, __file__.rsplit("/", 1)[0] + "/staged.py", threading.__file__})


def run_batch(
    models: StagedModels,
    fn: Callable[[Any], Any],
    items: Iterable[Any],
    *,
    return_exceptions: bool = False,
) -> list[Any]:
    """What :meth:`StagedModels.map` does; see there."""
    return Batch(models, fn, items).run(return_exceptions=return_exceptions)
