"""Stage-major batches: N calls of one pipeline, each stage entered once for all of them.

``StagedModels.map(fn, items)`` runs every ``fn(item)`` in its own thread, but only one
of them at any moment: a baton (a turn number, waited for on a :class:`~stageload.bell.Bell`)
passes between the calls and the scheduler, the thread that called ``map``. A call that
enters a stage other than the batch's current one parks there (inside ``enter``, before
its lock). Once every call has parked or finished, the scheduler enters the earliest
stage, in plan order, that a parked call waits for, once, and resumes the calls waiting
for it one at a time, in item order. The others stay parked.

Re-entry: a call that needs an earlier stage again (a negative-prompt pass, img2img's
VAE encode before the denoiser) parks like any other; "earliest in plan order" lets it
catch up before the rest move on, so the batch enters each stage as often as one call
would, never once per call, and nothing waits on anything but the scheduler.

Randomness belongs to the call: every call starts from the global RNG state at
``map()``'s entry, and the scheduler saves the running call's state and restores the
next one's at every switch (torch CPU/CUDA/MPS, ``random``, NumPy; see ``rng``).

Block-major: a streamed model (``stageload.stream``) parks a call at each block with
:meth:`Batch.gather` instead; calls parked for a block run before any stage change, the
smallest key first, so each block is loaded once for all the calls that reach it.

Threads: the scheduler alone enters stages for the batch; a call only runs while it holds
the turn. Loads happen in whichever thread asks for the model (``models[name]``), under
the registry's own lock, which no parked call holds.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..bell import Bell
from ..errors import StageloadError
from ..units import format_size
from .events import NOTE, Event
from .rng import RngState, capture_rng, restore_rng

if TYPE_CHECKING:
    from torch import nn

_SCHEDULER = -1
# The batch whose call runs on this thread (set in each call's own thread).
_running = threading.local()


#: A thread's torch modes, thread-local in torch, which a call run on another thread must
#: take: (grad enabled, inference mode, the autocast regions it is in: (device type, dtype,
#: cache) each).
Modes = tuple[bool, bool, tuple[tuple[str, Any, bool], ...]]
#: Device types ``torch.autocast`` may be on for (a type this torch lacks is skipped).
_AUTOCAST_DEVICES = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia")


def _autocasts() -> tuple[tuple[str, Any, bool], ...]:
    """The ``torch.autocast`` regions this thread is in: (device type, dtype, cache) each. Each
    call of a batch runs on a thread of its own, where torch's autocast state (thread
    local) starts off: ``pipe.stageload.map(...)`` inside ``torch.autocast`` computed in
    full precision, unlike the same calls made one by one."""
    import torch

    cache = torch.is_autocast_cache_enabled()
    found = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                found.append((device, torch.get_autocast_dtype(device), cache))
        except (TypeError, RuntimeError, ValueError, AttributeError):
            # torch < 2.4 asks per device; a device type this build does not know
            if device == "cpu" and torch.is_autocast_cpu_enabled():
                found.append((device, torch.get_autocast_cpu_dtype(), cache))
            elif device == "cuda" and torch.is_autocast_enabled():
                found.append((device, torch.get_autocast_gpu_dtype(), cache))
    return tuple(found)


def thread_modes() -> Modes:
    """This thread's grad, inference and autocast modes, for :func:`entered` on another."""
    import torch

    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), _autocasts())


@contextlib.contextmanager
def entered(modes: Modes) -> Iterator[None]:
    """Run the block in ``modes`` (:func:`thread_modes` of another thread), whatever this
    thread's are: a call of a batch runs on a thread of its own, and overlapping calls from
    several threads run in one batch, each in its caller's modes (a call made inside
    ``torch.autocast`` batched behind one made outside it ran in full precision)."""
    import torch

    grad, inference, casts = modes
    with contextlib.ExitStack() as stack:
        if torch.is_inference_mode_enabled() != inference:
            stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        wanted = {device for device, _, _ in casts}
        for device, _, _ in _autocasts():  # this thread's own, where the caller had none
            if device not in wanted:
                stack.enter_context(torch.autocast(device, enabled=False))
        for device, dtype, cache in casts:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        yield


def current_batch() -> Batch | None:
    """The batch whose call runs on this thread, or None outside any batch's calls."""
    return getattr(_running, "batch", None)


class BatchHost(Protocol):
    """What a batch needs of the registry it runs on (``StagedModels`` is one)."""

    @property
    def stage(self) -> str | None: ...

    @property
    def stages(self) -> Mapping[str, tuple[str, ...]]: ...

    def enter(self, stage: str) -> None: ...

    def emit(self, event: Event) -> None: ...

    def listening(self) -> bool:
        """Whether any sink gets :meth:`emit`'s events (the held-bytes note walks every
        object gc tracks, about 0.1 s a stage: made only for someone to read)."""
        ...

    def resident(self) -> dict[str, nn.Module]: ...


class BatchError(StageloadError, RuntimeError):
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


class _Abandoned(BaseException):
    """Unwinds a parked call when the batch is given up (the scheduler was interrupted)."""


class _Call:
    __slots__ = ("index", "item", "thread", "want", "key", "served", "done", "result", "error",
                 "rng")  # fmt: skip

    def __init__(self, index: int, item: Any, rng: RngState) -> None:
        self.index = index
        self.item = item
        self.thread: threading.Thread | None = None
        self.want: str | None = None  # the stage it is parked for
        self.key: tuple[int, ...] | None = None  # what it gathers for (gather)
        self.served = (0, 1)  # its place among the calls served for that key, and how many
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.rng = rng


class Batch:
    """One run of :meth:`StagedModels.map`: the registry runs it with :meth:`run`, and its
    ``enter`` calls :meth:`park` while the batch runs."""

    def __init__(self, models: BatchHost, fn: Callable[[Any], Any], items: Iterable[Any]):
        if not callable(fn):
            raise TypeError(f"map() takes the function to run first, got {fn!r}")
        self.models = models
        self._fn = fn
        self._items = list(items)
        self._order = {stage: k for k, stage in enumerate(models.stages)}
        # The turn: taken by `with` only, and waited for on the bell outside it (a Ctrl-C
        # in a Condition's wait left an RLock released under the scheduler's `with`, which
        # raised "cannot release un-acquired lock" in place of the KeyboardInterrupt).
        self._mutex = threading.Lock()
        self._bell = Bell()
        self._turn = _SCHEDULER
        self._abandoned = False
        self._calls: list[_Call] = []
        self._by_thread: dict[int, _Call] = {}
        self._before: set[int] | None = None  # storages alive before the calls ran
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

    def check(self) -> None:
        """In a call of this batch, once the batch was given up (a Ctrl-C in the
        scheduler): unwind the call now. For hooks that run between parks (a model's call
        in the stage the batch is in), so the running call stops at its next model call
        instead of running the rest of its stage (a denoiser's steps) before the Ctrl-C
        can be raised. Outside the batch's calls, or while it runs: nothing."""
        if self._abandoned and threading.get_ident() in self._by_thread:
            raise _Abandoned

    def gather(self, key: tuple[int, ...]) -> tuple[int, int]:
        """Park the calling call until the batch serves ``key`` (a streamed block).

        Once every live call has parked or ended, the calls parked for the smallest key run
        first (before any stage change), one at a time in item order. Returns
        ``(rank, count)``: this call's place among those served together, so the last one
        can free what they shared. Outside the batch's calls: ``(0, 1)`` at once.
        """
        call = self._by_thread.get(threading.get_ident())
        if call is None:
            return (0, 1)
        if self._abandoned:
            raise _Abandoned
        call.key = key
        try:
            self._hand_back(call)
        finally:
            call.key = None
        return call.served

    def _hand_back(self, call: _Call) -> None:
        self._pass(_SCHEDULER, call.index)
        if self._abandoned:
            raise _Abandoned

    def _body(self, call: _Call, context: contextvars.Context, modes: Modes) -> None:
        self._bell.wait(self._mutex, lambda: self._may_start(call))
        try:
            if self._abandoned:
                raise _Abandoned
            _running.batch = self
            with entered(modes):  # thread-local in torch: the caller's
                call.result = context.run(self._fn, call.item)
        except BaseException as exc:  # noqa: BLE001 (the scheduler decides what to raise)
            call.error = exc
        finally:
            with self._mutex:
                call.done = True
                if self._turn == call.index:  # not when it ends without the turn
                    self._turn = _SCHEDULER
                self._bell.ring()

    def _may_start(self, call: _Call) -> bool:
        """Under the lock: whether ``call`` may start: its turn came, or the batch was
        abandoned before it (a Ctrl-C while the calls' threads started, some before the
        scheduler counted them): then it ends at once, running nothing."""
        return self._turn == call.index or self._abandoned

    # -- the scheduler (the thread that called map) --------------------------------------
    def run(self, *, return_exceptions: bool = False) -> list[Any]:

        if not self._items:
            return []
        entry = capture_rng()
        modes = thread_modes()
        self._calls = [_Call(i, item, entry) for i, item in enumerate(self._items)]
        try:
            for call in self._calls:
                thread = threading.Thread(
                    target=self._body,
                    args=(call, contextvars.copy_context(), modes),
                    name=f"stageload-map-{call.index}",
                    daemon=True,  # a call stuck in native code must not keep the process alive
                )
                thread.start()
                call.thread = thread  # started: the abandon below waits for it
                assert thread.ident is not None
                self._by_thread[thread.ident] = call
            # What the batch's own tensors are counted beside; None: no note to write.
            self._before = _live_storages() if self.models.listening() else None
            for call in self._calls:  # setup: each call runs until its first stage change
                self._resume(call)
            while live := [c for c in self._calls if not c.done]:
                keys = [c.key for c in live if c.key is not None]
                if keys:  # blocks of the current stage before any stage change
                    key = min(keys)
                    group = [c for c in live if c.key == key]
                    for rank, call in enumerate(group):
                        call.served = (rank, len(group))
                        self._resume(call)
                    continue
                stage = min((c.want for c in live if c.want), key=self._rank)
                self._enter(stage, live)
                for call in live:
                    if call.want == stage:
                        self._resume(call)
        except BaseException:
            try:
                self._abandon()
            except BaseException:
                # A second Ctrl-C while the calls unwind (the running one may take a while
                # to reach its next park): raise now, and let a thread of our own finish the
                # unwinding, one call at a time as above. Left as they were, the parked
                # calls waited for their turn for good: their threads stayed, and so did
                # what they held (a model they were about to call counted as in use, over
                # the budget from then on).
                threading.Thread(
                    target=self._abandon, name="stageload-map-unwind", daemon=True
                ).start()
            raise
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

    def _rank(self, stage: str) -> int:
        """``stage``'s place in plan order. A host may add stages while the batch runs
        (auto's, by model, as calls first use them): read again for one not seen yet."""
        if stage not in self._order:
            self._order = {s: k for k, s in enumerate(self.models.stages)}
        return self._order.get(stage, len(self._order))

    def _resume(self, call: _Call) -> None:
        """Give ``call`` the turn with its own RNG state; return when it parks or ends."""
        restore_rng(call.rng)
        self._pass(call.index, _SCHEDULER)
        call.rng = capture_rng()
        self._stop_on_exit(call)

    def _stop_on_exit(self, call: _Call) -> None:
        """``call`` ended in sys.exit() or a KeyboardInterrupt raised in fn: a loop would
        stop there, and so does the batch (run's abandon unwinds the others), raising it as
        it is. Kept as an item's result, exit() ran the other items, then raised a
        BatchError: the process's exit status was lost."""
        if call.done and call.error is not None and not isinstance(call.error, Exception):
            raise call.error

    def _pass(self, turn: int, back: int | None = None) -> None:
        """Give the turn to ``turn`` (a call's index, or the scheduler); with ``back``,
        wait until it comes back to ``back``."""
        with self._mutex:
            self._turn = turn
            self._bell.ring()
        if back is not None:
            self._bell.wait(self._mutex, lambda: self._turn == back)

    def _enter(self, stage: str, live: list[_Call]) -> None:
        self.entered.append(stage)
        if self._before is not None:
            self._note_held(stage, live)
        self.models.enter(stage)  # the scheduler is no call: this is the real enter

    def _note_held(self, stage: str, live: list[_Call]) -> None:
        """Emit what parked calls and finished results hold besides the loaded models."""
        assert self._before is not None
        waiting = [c.index for c in live if c.want == stage]
        parked = len(live)
        held = held_bytes(self._before, self.models.resident())
        self.models.emit(
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

    def _abandon(self) -> None:
        """Unwind every unfinished call, one at a time, after the scheduler was interrupted."""
        with self._mutex:
            self._abandoned = True
            self._bell.ring()  # the calls that never had the turn end now, on their own
        # the running call parks or ends first
        self._bell.wait(self._mutex, lambda: self._turn == _SCHEDULER)
        for call in self._calls:
            if call.thread is not None and not call.done:
                # One at a time, each with the turn: its finally blocks may enter stages.
                with self._mutex:
                    self._turn = call.index
                    self._bell.ring()
                self._bell.wait(self._mutex, lambda c=call: self._turn == _SCHEDULER or c.done)
        for call in self._calls:
            if call.thread is not None and call.done:
                call.thread.join()
                self._drop(call)

    @staticmethod
    def _drop(call: _Call) -> None:
        """Forget what an ended call of an abandoned batch returned or raised. The
        interrupt's traceback keeps the batch (the scheduler's frame), and an unwound call's
        error keeps its own frames: what every item held, for as long as the traceback
        lives (in Jupyter, ``sys.last_traceback``), where a loop keeps the interrupted
        item's alone. No one reads them after an abandon."""
        call.result = call.error = None


def held_bytes(before: set[int], models: Mapping[str, nn.Module]) -> int:
    """Bytes of the tensor storages alive now that were not at ``before`` and that no
    loaded model holds: what parked calls and finished results keep between stages.

    Found with ``gc.get_objects()`` (torch tensors are tracked by the collector), so it
    sees tensors wherever they are held: a frame's locals, a closure, a cache. Not
    counted: memory no tensor owns (allocator caches, the call threads' stacks).
    """
    known = before | {ptr for module in models.values() for ptr in _storages(module)}
    return sum(n for ptr, n in _live_storage_sizes().items() if ptr not in known)


def _storages(module: nn.Module) -> set[int]:
    return {
        t.untyped_storage().data_ptr()
        for t in (*module.parameters(), *module.buffers())
        if not t.is_meta
    }


def _live_storage_sizes() -> dict[int, int]:
    import torch

    sizes: dict[int, int] = {}
    # Whether each type is a tensor's, asked once a type: a batch walks every object gc
    # tracks at each stage, and issubclass per object was a fifth of the walk: 124 ms ->
    # 97 ms a walk of 322 k objects (torch, diffusers and transformers imported; median of 7).
    tensor, strided, is_tensor = torch.Tensor, torch.strided, {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some objects that
        # gc tracks answer with a deprecation warning (torch.distributed.reduce_op).
        cls = type(obj)
        hit = is_tensor.get(cls)
        if hit is None:
            hit = is_tensor[cls] = issubclass(cls, tensor)
        if hit and not obj.is_meta and obj.layout == strided:
            storage = obj.untyped_storage()
            try:
                ptr = storage.data_ptr()
            except RuntimeError:  # torch.compile's fake tensors, alive in dynamo's caches
                continue
            if ptr:
                sizes[ptr] = storage.nbytes()
    return sizes


def _live_storages() -> set[int]:
    return set(_live_storage_sizes())


def run_batch(
    models: BatchHost,
    fn: Callable[[Any], Any],
    items: Iterable[Any],
    *,
    return_exceptions: bool = False,
) -> list[Any]:
    """What :meth:`StagedModels.map` does; see there."""
    return Batch(models, fn, items).run(return_exceptions=return_exceptions)
