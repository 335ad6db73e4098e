"""Stream a model larger than memory block by block from its checkpoint.

The mechanism; ``stageload.streamed`` (:mod:`stageload.stream`) hands it what lives above
``load/``: the batch a call may be part of (a :class:`MeetingPoint`) and where block
records go (events, the outer trace). So ``load/`` never imports ``core/``.

:func:`stream_blocks` builds the model with its weights on ``meta`` (the buffers its
constructor computes, such as rotary tables, are made for real: see
:mod:`stageload.load.meta`) and reads in everything outside its block list (embeddings,
norms, heads) at once. Each block stays on ``meta`` until it is called:
a :class:`~stageload.hooks.registry.ModuleHook` on the block reads it from the checkpoint
with the fast reader (``load.weights``) in its ``pre_call`` and frees it with
:func:`~stageload.release` in its ``post_call``. With ``prefetch``, the next block is read
on a background thread while the current one computes, so the peak is the parts outside
the blocks, two blocks and the working memory.

Block-major batches: under :meth:`StagedModels.map <stageload.StagedModels.map>`, a
block's ``pre_call`` parks the call at its batch's :class:`MeetingPoint` until every live
call has reached that block; the block is then read once and the calls run it one at a
time in item order. The last of them frees it. So a batch of N reads each block once per
step, not N times.

Threads, and who frees what:

- The calling thread (in a batch: whichever call holds the turn; calls never run at once)
  installs a block into the module, runs it and releases it. Calls from several threads
  outside a batch run one at a time, in the order they began (each waits at its first
  block: :meth:`HookRegistry.wait_for_turn`). A block is released only by
  its own ``post_call`` (in a batch: the last call served for it), or, left loaded by a
  call that raised, by the next block's ``pre_call``; never while a call runs it.
- The prefetch thread (one per stream, one block ahead) only reads into fresh tensors
  that nothing else sees: it never touches a module, the RNG or the running block. Its
  result is installed by the calling thread at the block's call; its error is raised
  there, naming the block.

A streamed model is for inference: its parameters do not require grad, and a call with
an input that requires grad (while grad mode is on) raises, since the backward pass would
need the freed weights.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import StageloadError
from ..external import non_persistent_buffers
from ..hooks.registry import HookRegistry, ModuleHook
from ..hooks.release import is_released, release
from .checkpoint import Entry, check_unchanged, checkpoint_files, file_stamps, read_entries
from .loaders import check_build
from .meta import build_on_meta
from .placement import COPIED, Placement
from .reader import background_thread
from .weights import Files, LoadPlan, default_threads, install, plan, read, targets

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "BlockDone",
    "MeetingPoint",
    "Stream",
    "StreamError",
    "StreamStats",
    "find_blocks",
    "no_batch",
    "stream_blocks",
    "stream_of",
]

#: The name of the hook on a streamed model and on each of its blocks.
STREAM = "stream"

_keys = itertools.count()  # each stream's first key part: blocks of two streams never mix


class StreamError(StageloadError, RuntimeError):
    """A model cannot be streamed as asked, or a block's read failed (the cause chained)."""


class MeetingPoint(Protocol):
    """Where the calls of a batch meet at a block (``core.batch.Batch`` is one)."""

    def gather(self, key: tuple[int, ...]) -> tuple[int, int]:
        """Park the calling call until the batch serves ``key``; returns its ``(rank,
        count)`` among the calls served together (``(0, 1)`` for a call outside it)."""
        ...


def no_batch() -> MeetingPoint | None:
    """The meeting point of a stream used outside any batch: none."""
    return None


@dataclass(frozen=True)
class BlockDone:
    """One block's residency, reported when it is freed: what it read and computed."""

    model: str
    path: str  # the block's path in the model
    bytes: int
    seconds: float  # its read's
    compute: float  # seconds its forwards ran, over the calls served
    prefetched: bool


@dataclass
class StreamStats:
    """What a stream did so far, over all its calls."""

    #: Blocks read from the checkpoint (one per block per step in a block-major batch).
    blocks_loaded: int = 0
    bytes_read: int = 0
    #: Seconds the reads took, wherever they ran (overlapped with compute when prefetched).
    read_seconds: float = 0.0
    #: Seconds the computing thread waited for a block's read.
    wait_seconds: float = 0.0
    #: Seconds the blocks' forwards ran (every call's).
    compute_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Block:
    """One block: where it sits, its checkpoint entries (keys relative to it), its state."""

    def __init__(self, index: int, path: str, module: nn.Module, entries: dict[str, Entry]):
        self.index = index
        self.path = path
        self.module = module
        self.entries = entries
        self.resident = False
        self.release_after = True  # set at each pre_call: is this call the last to use it
        self.started = 0.0
        self.read_bytes = 0  # of this residency
        self.read_seconds = 0.0
        self.compute = 0.0
        self.prefetched = False


_Read = tuple[LoadPlan, dict[int, "torch.Tensor"], int, float]  # plan, tensors, bytes, s


class _Pending:
    """The prefetch of one block: its targets (made on the calling thread) and the read."""

    def __init__(self, index: int, future: Future[_Read]) -> None:
        self.index = index
        self.future = future


class Stream:
    """The streaming state of one model (see :func:`stream_blocks`); :func:`stream_of`
    finds it."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[tuple[str, nn.Module]],
        paths: list[Path],
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        prefetch: bool,
        name: str,
        threads: int,
        placement: Placement = COPIED,
        meeting: Callable[[], MeetingPoint | None] = no_batch,
        on_block: Callable[[BlockDone], None] | None = None,
    ) -> None:
        self.model = model
        self.placement = placement
        self.name = name
        self.device = device
        self.dtype = dtype
        self.prefetch = prefetch
        self.threads = threads
        self.paths = paths
        self.stats = StreamStats()
        self.meeting = meeting  # the batch this thread's call is part of, if any
        self._on_block = on_block
        self._key = next(_keys)
        self._pending: _Pending | None = None
        self._executor: ThreadPoolExecutor | None = None
        # Before the headers are read: a change during the read shows at the first block.
        self._stamps = file_stamps(paths, sampled=True)
        entries = read_entries(paths)
        prefixes = [f"{path}." for path, _ in blocks]
        split: list[dict[str, Entry]] = [{} for _ in blocks]
        self._rest: dict[str, Entry] = {}
        for key, entry in entries.items():
            at = next((k for k, p in enumerate(prefixes) if key.startswith(p)), None)
            if at is None:
                self._rest[key] = entry
            else:
                split[at][key[len(prefixes[at]) :]] = entry
        self.blocks = [_Block(i, path, module, split[i]) for i, (path, module) in enumerate(blocks)]
        self._check_ties(prefixes)
        for block in self.blocks:  # a block the checkpoint does not fit fails now, not mid-call
            self._plan(block)

    def __getstate__(self) -> dict[str, Any]:
        # A copy of the model (copy.deepcopy) streams on its own: no read of the original's
        # in flight, and a prefetch thread of its own when it needs one.
        state = dict(self.__dict__)
        state.update(_pending=None, _executor=None)
        return state

    # -- public ---------------------------------------------------------------------------
    @property
    def paths_of_blocks(self) -> list[str]:
        """The blocks' paths in the model, in the order they are streamed."""
        return [b.path for b in self.blocks]

    def resident(self) -> list[str]:
        """Paths of the blocks whose weights are in memory now."""
        return [b.path for b in self.blocks if b.resident]

    def close(self) -> None:
        """Free every block still loaded and the prefetched one; stop the prefetch thread.
        Call it from the thread that runs the model, not while a call runs."""
        self._drop_pending()
        for block in self.blocks:
            if block.resident:
                self._release(block)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    # -- building -------------------------------------------------------------------------
    def _check_ties(self, prefixes: list[str]) -> None:
        """A tensor shared across a block's edge would be freed under its other users."""
        for target in targets(self.model):
            owners = {
                next((k for k, p in enumerate(prefixes) if n.startswith(p)), -1)
                for n in target.names
            }
            if len(owners) > 1:
                raise StreamError(
                    f"{', '.join(target.names)} is one tensor shared between "
                    f"{' and '.join('the rest' if k < 0 else self.blocks[k].path for k in owners)}"
                    "; a streamed block must own its weights (stream a list whose blocks do "
                    "not share tensors with each other or with the rest)"
                )

    def load_rest(self) -> int:
        """Read every tensor outside the blocks; returns its bytes."""
        import torch

        prefixes = tuple(f"{b.path}." for b in self.blocks)
        rest = [t for t in targets(self.model) if not t.names[0].startswith(prefixes)]
        try:
            planned = plan(rest, self._rest, self.paths)
            with torch.no_grad():
                results, nbytes = read(
                    planned, self.device, self.dtype, self.threads, self.placement
                )
                install(self.model, planned, results, self.device, self.dtype, strict=True)
        except BaseException:
            release(self.model)
            raise
        return nbytes

    # -- a block's call (the calling thread) ----------------------------------------------
    def _enter(self, index: int, served: tuple[int, int]) -> None:
        block = self.blocks[index]
        for other in self.blocks:  # left loaded by a call that raised inside it
            if other.resident and other is not block:
                self._release(other)
        # The flag says what this stream did last; a Ctrl-C between a release and its flag
        # left it saying loaded: every later call then met a released block.
        if not block.resident or is_released(block.module):
            self._load(block)
        rank, count = served
        block.release_after = rank == count - 1
        if self.prefetch:
            self._prefetch(index + 1)
        block.started = time.perf_counter()

    def _leave(self, index: int) -> None:
        block = self.blocks[index]
        seconds = time.perf_counter() - block.started
        block.compute += seconds
        self.stats.compute_seconds += seconds
        if block.release_after and block.resident:
            self._release(block)

    def _load(self, block: _Block) -> None:
        import torch

        start = time.perf_counter()
        pending = self._pending
        if pending is not None and pending.index != block.index:
            self._drop_pending()  # a wrong guess (blocks called out of order)
            pending = None
        if pending is not None:
            self._pending = None
            try:
                planned, results, nbytes, seconds = pending.future.result()
            except Exception as exc:
                raise StreamError(
                    f"reading block {block.path!r} of {self.name!r} from "
                    f"{', '.join(str(p) for p in self.paths)} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not all(getattr(s, k) is t.tensor for t in planned.targets for s, k in t.places):
                planned, results, nbytes, seconds = self._read(self._plan(block))  # replaced
            block.prefetched = True
        else:
            planned, results, nbytes, seconds = self._read(self._plan(block))
            block.prefetched = False
        self.stats.wait_seconds += time.perf_counter() - start
        try:
            with torch.no_grad():
                install(block.module, planned, results, self.device, self.dtype, strict=True)
        except BaseException:
            release(block.module)
            raise
        block.resident = True
        block.read_bytes, block.read_seconds, block.compute = nbytes, seconds, 0.0
        self.stats.blocks_loaded += 1
        self.stats.bytes_read += nbytes
        self.stats.read_seconds += seconds

    def _plan(self, block: _Block) -> LoadPlan:
        check_unchanged(
            self._stamps,
            f"since {self.name!r} was built to stream from it: its blocks would be read at "
            "the offsets of the file as it was",
            fix="restore the file, or build the streamed model again",
        )
        try:
            return plan(targets(block.module), block.entries, self.paths, strict_hint=False)
        except ValueError as exc:
            raise StreamError(f"block {block.path!r} of {self.name!r}: {exc}") from None

    def _read(self, planned: LoadPlan) -> _Read:
        """Read a planned block into fresh tensors (any thread; touches no module)."""
        import torch

        start = time.perf_counter()
        with torch.no_grad():
            results, nbytes = read(planned, self.device, self.dtype, self.threads, self.placement)
        return planned, results, nbytes, time.perf_counter() - start

    def _prefetch(self, index: int) -> None:
        if index >= len(self.blocks) or self.blocks[index].resident or self._pending is not None:
            return
        planned = self._plan(self.blocks[index])  # here: the module is read on this thread
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="stageload-stream", initializer=background_thread
            )
        self._pending = _Pending(index, self._executor.submit(self._read, planned))

    def _drop_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.exception()  # wait: its tensors go with it, its error unseen

    def _release(self, block: _Block) -> None:
        # In a batch the other calls are parked (one runs at a time), some of them inside
        # this block's pre_call, waiting to be served the next read: waiting for their
        # calls in flight would wait for calls that cannot move. Outside a batch, a call
        # on another thread may be computing in the block: wait for it.
        in_batch = self.meeting() is not None
        block.resident = False  # first: a Ctrl-C in the release leaves it to be read again
        release(block.module, name=f"{self.name}.{block.path}", wait=not in_batch)
        if self._on_block is not None:
            self._on_block(
                BlockDone(
                    self.name,
                    block.path,
                    block.read_bytes,
                    block.read_seconds,
                    block.compute,
                    block.prefetched,
                )
            )


class _BlockHook(ModuleHook):
    """On each block: read it before its forward, free it after (see the module doc)."""

    def __init__(self, stream: Stream, index: int) -> None:
        self.stream = stream
        self.index = index

    def pre_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stream = self.stream
        _check_no_grad(stream, args, kwargs)
        batch = stream.meeting()
        if batch is None:
            # Calls from several threads (a server's): one at a time, in the order they
            # began. Blocks are read into, run and freed in place: two calls at once read a
            # block into memory the other freed (EFAULT, heap corruption, a segfault).
            registry = HookRegistry.of(stream.model)
            if registry is not None:
                registry.wait_for_turn()
            served = (0, 1)
        else:  # wait here until every call of the batch has reached this block: read once
            served = batch.gather((stream._key, self.index))
        stream._enter(self.index, served)
        return None

    def post_call(self, module: nn.Module, output: Any) -> Any:
        self.stream._leave(self.index)
        return output

    def retain(self, module: nn.Module) -> Iterable[torch.Tensor]:
        # A block's computed buffers (non-persistent) are not in the checkpoint: a release
        # that freed them could not be undone by the next read.
        return [
            t
            for sub in module.modules()
            for key, t in sub.named_buffers(recurse=False)
            if key in non_persistent_buffers(sub)
        ]


class _ModelHook(ModuleHook):
    """On the streamed model itself: how :func:`stream_of` finds its stream."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def released(self, module: nn.Module) -> None:
        # Released as a whole (a stage change): its blocks went with it. The prefetch thread
        # is stopped now: left to the garbage collector, its executor's finalizer ran in the
        # release's gc.collect(), where a Ctrl-C is lost ("Exception ignored in weakref_cb":
        # 8 of 16 interrupts of StagedModels.enter, a new-user helper).
        stream = self.stream
        if module is stream.model:
            for block in stream.blocks:
                block.resident = False
            stream.close()


def _check_no_grad(stream: Stream, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    import torch

    if not torch.is_grad_enabled():
        return
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise StreamError(
                f"{stream.name!r} is streamed: its blocks are freed right after their forward, "
                "so autograd cannot use them; call it under torch.no_grad() or "
                "torch.inference_mode(), or load it whole (from_safetensors) to train"
            )


def stream_of(model: nn.Module) -> Stream | None:
    """The :class:`Stream` of a model made by :func:`stream_blocks`, else None."""
    registry = HookRegistry.of(model)
    hook = registry.get(STREAM) if registry is not None else None
    return hook.stream if isinstance(hook, _ModelHook) else None


def _block_lists(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """Every non-empty ModuleList or Sequential below the model: (path, list, elements)."""
    from torch import nn

    return [
        (path, sub, sum(p.numel() for p in sub.parameters()))
        for path, sub in model.named_modules()
        if path and isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub)
    ]


def find_blocks(
    model: nn.Module, blocks: str | Sequence[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """The blocks to stream, in order, as ``(path, module)``.

    ``blocks=None``: the list holding the most parameters (an ``nn.ModuleList`` or
    ``nn.Sequential``); a path (``"transformer_blocks"``) or several (streamed one after
    the other, e.g. Flux's ``["transformer_blocks", "single_transformer_blocks"]``).
    """
    lists = _block_lists(model)
    found = ", ".join(f"{p!r} ({len(m)} x, {n:,} parameters)" for p, m, n in lists) or "none"
    if blocks is None:
        if not lists:
            raise StreamError(
                f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks to "
                "stream; pass blocks='path.to.list' naming the modules called one after another"
            )
        paths = [max(lists, key=lambda x: x[2])[0]]
    else:
        paths = [blocks] if isinstance(blocks, str) else list(blocks)
        if not paths:
            raise StreamError("blocks=[] names no block list")
    by_path = {p: m for p, m, _ in lists}
    out: list[tuple[str, nn.Module]] = []
    for path in paths:
        if path not in by_path:
            raise StreamError(
                f"{type(model).__name__} has no non-empty nn.ModuleList or nn.Sequential at "
                f"{path!r}; the lists it has: {found}"
            )
        out += [(f"{path}.{name}", sub) for name, sub in by_path[path].named_children()]
    names = [p for p, _ in out]
    for a in names:
        if any(b != a and b.startswith(f"{a}.") for b in names):
            raise StreamError(f"the block lists overlap at {a!r}; name lists side by side")
    return out


def stream_blocks(
    build: Callable[[], nn.Module],
    files: Files,
    *,
    blocks: str | Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    prefetch: bool = True,
    name: str | None = None,
    threads: int | None = None,
    placement: Placement = COPIED,
    meeting: Callable[[], MeetingPoint | None] = no_batch,
    on_block: Callable[[BlockDone], None] | None = None,
) -> nn.Module:
    """Build a model on ``meta`` and stream its blocks from ``files`` at each call
    (``stageload.streamed`` is this, with the batch and the events of the core handed in).

    Everything outside the block list is read now; each block is read when it is called
    and freed right after (:mod:`stageload.stream`). The output is bit-identical to
    ``from_safetensors(build, files, dtype=, device=)()``'s, at a peak of the parts outside
    the blocks, two blocks (one with ``prefetch=False``) and the working memory.

    Args:
        build: makes the model. Its parameters go to ``meta`` as they are registered, so
            their initialisers take no memory and draw no random numbers; its buffers are
            made as the constructor makes them, and those the checkpoint holds then go to
            ``meta``, so computed ones (rotary tables) are right. A constructor that draws
            numbers outside the initialisers (``nn.Parameter(torch.randn(...))``) draws
            them (:func:`stageload.load.meta.meta_parameters`).
        files: as :func:`~stageload.load_weights` takes them.
        blocks: the block list's path (or several, in call order); default: the
            ``nn.ModuleList`` (or ``nn.Sequential``) with the most parameters.
        dtype, device: as :func:`~stageload.load_weights`.
        prefetch: read the next block on a background thread while one computes.
        name: the model's name in its records (default: its class name).
        threads: reader threads per read (default as ``load_weights``).
        placement: where each block's tensors start, mod 64, as the loader the output is
            compared with puts them (as ``load_weights``; :mod:`stageload.load.placement`):
            ``COPIED`` (default) for ``from_safetensors`` or ``load_state_dict`` into a
            module built on the CPU, ``MAPPED`` for ``from_pretrained`` or ``load_file``.

        meeting: returns the batch the calling thread's call is part of, or None; calls
            of one batch meet at each block, which is then read once for all of them.
        on_block: called with each block's :class:`BlockDone` as it is freed.

    :func:`stream_of` returns the model's :class:`Stream` (its ``stats``, ``close()``).
    """
    import torch
    from torch import nn

    check_build(build, "streamed")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    # Absolute: a script that changes its directory must not stream from other files.
    paths = [path.absolute() for path in checkpoint_files(files)]
    # Not torch.device("meta"): buffers computed in __init__ would be meta tensors that no
    # checkpoint can fill. Computed buffers go to `device` with the rest (load_rest) or
    # with their block.
    model = build_on_meta(build)
    if not isinstance(model, nn.Module):
        raise TypeError(f"build() returned {type(model).__name__}, not an nn.Module")
    model.requires_grad_(False)  # inference only: the weights go after each forward
    stream = Stream(
        model,
        find_blocks(model, blocks),
        paths,
        device=torch.device(device) if device is not None else torch.device("cpu"),
        dtype=dtype,
        prefetch=prefetch,
        name=name or type(model).__name__,
        threads=threads or default_threads(),
        placement=placement,
        meeting=meeting,
        on_block=on_block,
    )
    stream.load_rest()
    HookRegistry.attach(model).add(STREAM, _ModelHook(stream))
    for block in stream.blocks:
        HookRegistry.attach(block.module).add(STREAM, _BlockHook(stream, block.index))
    return model
