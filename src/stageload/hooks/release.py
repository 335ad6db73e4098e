"""Free a module's weights in place and give the memory back to the operating system.

Moving idle weights to the CPU frees nothing on unified memory (Apple Silicon, CPU-only
machines): the copy lives in the same RAM. Releasing moves every parameter and buffer to
the ``meta`` device instead, which has no storage.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

from ..errors import StageloadError, warn_caller
from ..external import tensor_use_count
from .registry import HookRegistry, ModuleHook, end_hold, hold_calls, in_call, new_hold

#: The name of the hook :func:`release` adds to every module it empties.
RELEASED = "released"
#: The devices whose freed memory a release gives back (malloc's heap, the CUDA and MPS caches).
DEVICES = ("cpu", "cuda", "mps")


class ReleasedModuleError(StageloadError, RuntimeError):
    """A module was called after its weights were released."""

    def __init__(self, name: str | None, stage: str | None, *, closed: bool = False) -> None:
        self.name = name
        self.stage = stage
        self.closed = closed
        what = f"model {name!r}" if name else "this module"
        if closed:  # released for good by the stager's close(): nothing loads it again
            during = f" during stage {stage!r}" if stage else " before its first call"
            super().__init__(
                f"{what} was released when its staged pipeline was closed{during} "
                "(pipe.stageload.close()), and a closed pipeline loads nothing: build it "
                "again with staged_pipeline(...)"
            )
            return
        if name is None and stage is None:  # release(module), or a load_weights that failed
            super().__init__(
                "this module was released (by stageload.release, or by a load into it that "
                "failed or was interrupted): its weights are on the 'meta' device. Load them "
                "again (load_weights), or call the model your loader makes"
            )
            return
        when = f" when the pipeline entered stage {stage!r}" if stage else ""
        super().__init__(
            f"{what} was released{when}: its weights are on the 'meta' device. "
            "Get the model from the registry again (models[name]) instead of keeping a "
            "reference to the released object, or list it in that stage's plan."
        )


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    for sub in module.modules():
        yield from _own_tensors(sub)


def _own_tensors(sub: nn.Module) -> Iterable[torch.Tensor]:
    yield from sub.parameters(recurse=False)
    yield from sub.buffers(recurse=False)


def held_outside(
    tensors: Iterable[tuple[str, torch.Tensor]], skip: Collection[int] = ()
) -> list[tuple[str, torch.Tensor]]:
    """Of a module's ``tensors`` (name, tensor: ``named_tensors``), those whose memory
    something outside the module still holds, in order: a view the script took (``w =
    model.weight[0:4]``), a ``state_dict()`` it keeps, a tensor shared with another model.
    A release would free memory under the holder (or, where the holder keeps the storage
    alive, leave it a copy the model no longer reads). Counted per storage: the module's
    own tensors on it, the tensors a view among them was made from (a buffer registered as
    ``x.unsqueeze(0)``, as diffusers' PixArt position embedding is: the view holds its
    base), plus the one storage object held here. ``skip``: ids of tensors left out (ones
    a release keeps anyway). Read with torch functions off for a released module."""
    from ..external import storage_use_count

    by_storage: dict[tuple[Any, int], list[Any]] = {}  # -> [tensors counted, storage, named]
    seen: set[int] = set(skip)
    for name, t in tensors:
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        entry = by_storage.setdefault((t.device, storage.data_ptr()), [0, storage, []])
        entry[0] += 1
        entry[2].append((name, t))
        base = t._base
        if base is not None and id(base) not in seen and _only_its_views_hold(base):
            seen.add(id(base))
            entry[0] += 1
        del storage, base
    held = []
    for counted, storage, named in by_storage.values():
        if storage.nbytes() and storage_use_count(storage) > counted + 1:
            held.extend(named)
    return held


def _only_its_views_hold(base: Any) -> bool:
    """No Python object other than the views made from it holds ``base`` (the tensor a
    view among a module's tensors was made from, held in the caller's local): the script
    has no way to read it."""
    return sys.getrefcount(base) <= _refs_of_a_lone_base()


@functools.cache
def _refs_of_a_lone_base() -> int:
    """What :func:`_only_its_views_hold` counts for a tensor nothing but its view holds,
    counted the same way (a local, a parameter, getrefcount's argument): the count
    depends on the interpreter, the comparison does not."""
    import torch

    with torch.inference_mode(False):  # an inference tensor's view records no base
        view = torch.zeros(1).unsqueeze(0)
    base = view._base
    if base is None:  # never: then no base counts as the module's own
        return 0
    return _count(base)


def _count(base: Any) -> int:
    return sys.getrefcount(base)


def storage_sizes(module: nn.Module) -> dict[tuple[str, int], int]:
    """Each storage a module's parameters and buffers hold (not on meta): key -> bytes."""
    return {
        _storage_key(t): t.untyped_storage().nbytes() for t in _tensors(module) if not t.is_meta
    }


def module_bytes(module: nn.Module, *, exclude: Iterable[nn.Module] = ()) -> int:
    """Bytes held by a module's parameters and buffers, counting shared storage once.

    Storage that a module in ``exclude`` also holds is not counted: a load then reports
    only what it added, and a release what it freed.
    """
    held = {key for other in exclude for key in storage_sizes(other)}
    return sum(n for key, n in storage_sizes(module).items() if key not in held)


def held_elsewhere(module: nn.Module, others: Mapping[str, nn.Module]) -> str | None:
    """Why releasing ``module`` beside ``others`` frees less than it holds: how much of its
    storage the named modules still hold (a shared backbone, a submodule), and how much
    autograd holds (:func:`held_by_autograd`), or None."""
    from ..units import format_size

    mine = storage_sizes(module)
    holders: list[str] = []
    shared: set[tuple[str, int]] = set()
    for name, other in others.items():
        common = mine.keys() & storage_sizes(other).keys()
        if common:
            holders.append(repr(name))
            shared |= common
    graph = _autograd_held(module, shared)
    said = []
    if shared:
        kept = format_size(sum(mine[key] for key in shared))
        said.append(f"{kept} of its weights stay, still held by {', '.join(holders)}")
    if graph:
        said.append(_autograd_note(format_size(graph)))
    return "; ".join(said) or None


def _autograd_note(size: str) -> str:
    """What a release of weights autograd holds (:func:`held_by_autograd`) did, and the way
    out: said in the release's warning and in a staged release's note."""
    return (
        f"an autograd graph held {size} of its weights (an output computed with gradients "
        f"on, or a view of them): a backward through that graph now raises an error. "
        f"Inference: call it under torch.no_grad(); training through it or of it: keep it "
        f"loaded until the optimizer's step"
    )


def held_by_autograd(t: torch.Tensor, *, slots: int = 0) -> bool:
    """Whether autograd holds the tensor ``t`` itself, beyond its Python object: a graph
    that saved it for a backward still to come (a LayerNorm's or a convolution's weight),
    a graph that will accumulate a gradient into it (its accumulator holds it), or a view
    made from it with autograd on (a Linear's ``weight.t()``, which a graph saves; a slice
    the script keeps). Freed, its memory would be read by that holder: the backward failed
    deep in a kernel ('weight of shape [0]') or crashed the interpreter, and so did a read
    of the view.

    Read from the TensorImpl's references (``Tensor._use_count``): one from its Python
    object, ``slots`` more from C++ objects that hold it as their own (a TorchScript
    module's attribute), and one per holder."""
    if t.is_meta or t.is_inference():  # inference tensors record no views, no graph
        return False
    return tensor_use_count(t) > 1 + slots


def _retained(module: nn.Module) -> set[int]:
    """The ids of the tensors ``module``'s hooks keep through a release
    (:meth:`~stageload.hooks.registry.ModuleHook.retain`)."""
    registry = HookRegistry.of(module)
    return {id(t) for hook in (registry.hooks() if registry else ()) for t in hook.retain(module)}


def _to_release(
    module: nn.Module,
    skip: Iterable[tuple[str, int]] = (),
    kept: Iterable[int] = (),
    retained: set[int] | None = None,
) -> Iterator[tuple[torch.Tensor, int]]:
    """Each tensor a release of ``module`` takes (not on meta, not retained, on no storage
    in ``skip``, of no submodule whose id is in ``kept``), with the references C++ objects
    hold on it as their own (``slots`` of :func:`held_by_autograd`). ``retained``: the
    release's :func:`_retained`, asked once (each hook's ``retain`` walks the tensors)."""
    import torch

    skip, kept = set(skip), set(kept)
    retained = _retained(module) if retained is None else retained
    for sub in module.modules():
        if id(sub) in kept:
            continue
        # A TorchScript module's C++ object holds its tensors too; a release replaces them.
        slots = int(isinstance(sub, torch.jit.ScriptModule))
        for t in _own_tensors(sub):
            if not t.is_meta and id(t) not in retained and _storage_key(t) not in skip:
                yield t, slots


def _autograd_held(
    module: nn.Module,
    skip: Iterable[tuple[str, int]] = (),
    kept: Iterable[int] = (),
    *,
    cut: bool = False,
    retained: set[int] | None = None,
) -> int:
    """The bytes of the storages a release of ``module`` frees (as :func:`_to_release`)
    with a tensor autograd holds (:func:`held_by_autograd`). ``cut``: give each such
    tensor a new version too, so a backward that needs it raises instead of reading it
    freed (:func:`_cut_from_autograd`)."""
    import torch

    sizes: dict[tuple[str, int], int] = {}
    for t, slots in _to_release(module, skip, kept, retained):
        if held_by_autograd(t, slots=slots):
            sizes[_storage_key(t)] = t.untyped_storage().nbytes()
            if cut:
                torch.autograd.graph.increment_version(t)
    return sum(sizes.values())


class ReleasedHook(ModuleHook):
    """On a module :func:`release` emptied: a call asks the hooks of ``owner`` (the module
    released as a whole) whether one revives it, and raises ReleasedModuleError if none
    does. Without this, the call would fail deep in torch on a meta tensor."""

    def __init__(self, name: str | None, stage: str | None, owner: nn.Module) -> None:
        self.name = name
        self.stage = stage
        self.owner = owner

    def pre_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        registry = HookRegistry.of(self.owner)
        for hook in registry.hooks() if registry is not None else ():
            if hook.revive(self.owner):
                return None
        raise ReleasedModuleError(self.name, self.stage)

    def before_copy(self) -> None:
        # Copied before any of its tensors (a part that holds none, a ReLU, pickled first):
        # the owner's hooks bring the weights back now, so the copy holds them and no
        # release hook (which would make the copy raise, and need stageload to load).
        registry = HookRegistry.of(self.owner)
        for hook in registry.hooks() if registry is not None else ():
            if hook is not self:
                hook.before_copy()


def is_released(module: nn.Module) -> bool:
    """True when ``module`` was released by :func:`release` (and not filled since)."""
    registry = HookRegistry.of(module)
    return registry is not None and RELEASED in registry


# This thread's open releasing() blocks, whether a release ran inside them, and whether one
# of them asked for a collection.
_batch = threading.local()


@contextmanager
def releasing(*, collect: bool = True) -> Iterator[None]:
    """Releases inside the block collect garbage once, at its end, instead of once each
    (``StagedModels.enter``, ``evict`` and ``close`` release in one such block).

    ``collect=False``: no collection at all. Each release empties its storage in place and
    gives the memory back (malloc's heap trimmed, device caches emptied), so the weights
    come back without one; the collection, which walks the whole heap (80-180 ms once
    torch is imported here), only frees the script's own dead cycles. ``stageload.auto``
    releases this way. Nested blocks collect if any of them asked to."""
    depth = getattr(_batch, "depth", 0)
    try:  # set inside: a Ctrl-C between the two left the depth raised, and no later
        # release of this thread collected
        _batch.depth = depth + 1
        _batch.collect = getattr(_batch, "collect", False) or collect
        yield
    finally:
        _batch.depth = depth
        if depth == 0:
            # (collect may be unset: a Ctrl-C just after the depth was set)
            released, collect = (
                getattr(_batch, "released", False),
                getattr(_batch, "collect", False),
            )
            _batch.released = _batch.collect = False
            if released and collect:
                collect_garbage()


def collect_garbage() -> None:
    """Free dead reference cycles (one ``gc.collect()``) and give their memory back.

    A cycle holding tensors (an exception's traceback, a closure over a model) is freed
    only by a collection; with ``gc.disable()`` or a quiet allocator, never. The earlier
    stageload's ``release`` collected; so does ours, once per release or per
    :func:`releasing` block (its cost: ``bench/results/release_gc/``).
    """
    gc.collect()
    return_memory_to_os(DEVICES, collect=False)  # a cycle may hold any


def release(
    module: nn.Module,
    *,
    name: str | None = None,
    stage: str | None = None,
    keep: Iterable[nn.Module] = (),
    wait: bool = True,
    on_wait: Callable[[int], None] | None = None,
    on_cut: Callable[[int], None] | None = None,
) -> int:
    """Free ``module``'s weights in place and return the number of bytes freed.

    Every parameter and buffer moves to ``meta``: the module's tensor objects stay (they
    become meta tensors), and their old storage is emptied, so the memory comes back even
    while other code holds a view of it. Storage shared with a module in ``keep`` (and
    submodules that belong to one) is left alone, and so are the tensors the module's own
    hooks retain (:meth:`~stageload.hooks.registry.ModuleHook.retain`: a user's changes to
    a staged component). Afterwards, calling the module or any released submodule raises
    :class:`ReleasedModuleError` naming ``name`` and ``stage``, unless a hook revives it.

    Calls in flight on other threads (of the module or a hooked submodule) are waited for
    first, and new ones wait until the release is done, then raise (or are revived):
    weights are never freed under a running call. ``on_wait(n)`` is told once when ``n``
    calls are waited for. ``wait=False`` skips that, for callers whose other threads are
    parked, not computing (a stage-major batch).

    A Ctrl-C (any interrupt) during a release is raised once the release is done: a
    module is released whole, never left half on ``meta``.

    Weights an autograd graph holds (an output computed with gradients on, whose backward
    is still to come; :func:`held_by_autograd`) are freed all the same, and get a new
    version first: a backward through that graph raises autograd's own error instead of
    reading freed memory, and a ``UserWarning`` says which model and the way out
    (:func:`warn_cut`); ``on_cut(nbytes)`` is told instead, for a caller that records the
    release before it warns (a script run with ``-W error`` gets the warning raised).

    Dead reference cycles are collected once afterwards (``gc.collect()``): once per
    :func:`releasing` block instead inside one, and not at all from inside a hooked
    module's call (a streamed block released after its forward: a forward must not pay a
    full collection per block).
    """
    from torch import nn

    if not isinstance(module, nn.Module):
        raise TypeError(f"release() expects an nn.Module, got {type(module).__name__}")
    keep = list(keep)
    wrong = next((k for k in keep if not isinstance(k, nn.Module)), None)
    if wrong is not None:
        raise TypeError(
            f"release(keep=...) takes the modules whose storage must stay, got a "
            f"{type(wrong).__name__}"
        )
    done = _Progress()  # over every pass
    # A Ctrl-C while waiting for calls in flight leaves the module as it was; once the
    # tensors start to go, they all go (inside the hold, so no call sees half of them).
    # The hold is made here, before the try, so no interrupt can leave it behind.
    hold = new_hold()
    try:
        if wait:
            hold_calls(hold, module.modules(), on_wait=on_wait, unhooked=True)
        interrupt = to_the_end(functools.partial(_release, module, name, stage, keep, done))
    finally:
        hold.active = False  # one store: over, whatever interrupts the rest
        end_hold(hold)
    for storage in done.storages:  # a pass interrupted between a tensor and its storage
        if storage.nbytes():
            with suppress(RuntimeError):  # not resizable: it goes with its last view
                storage.resize_(0)
    done.storages.clear()  # before giving memory back: the last reference may be these
    done.replaced.clear()
    return_memory_to_os(done.devices, collect=False)
    if getattr(_batch, "depth", 0):
        _batch.released = True
    elif not in_call():
        collect_garbage()
    if interrupt is not None:
        raise interrupt
    if done.cut and on_cut is not None:
        on_cut(done.cut)
    elif done.cut:  # last: a warning the script made an error (-W error) finds it released
        warn_cut(name, done.cut)
    return sum(done.freed.values())


def warn_cut(name: str | None, nbytes: int) -> None:
    """The ``UserWarning`` of a release that freed ``nbytes`` an autograd graph held (see
    :func:`release`), at the script's line."""
    from ..units import format_size

    what = f"model {name!r}" if name else "a module"
    warn_caller(f"{what} was released while {_autograd_note(format_size(nbytes))}")


@dataclass
class _Progress:
    """What a release did so far, kept across the passes a Ctrl-C makes it run: each
    storage it frees (recorded before its tensor goes to meta: a pass interrupted right
    after would skip that tensor, now on meta), the devices, the meta twins that keep tied
    weights tied, and the storages to empty at the end."""

    freed: dict[tuple[str, int], int] = field(default_factory=dict)
    devices: set[str] = field(default_factory=set)
    #: Old tensor id -> (the old tensor, kept so its id stays its own; its meta twin).
    replaced: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    storages: list[Any] = field(default_factory=list)
    #: The bytes of the storages autograd held (:func:`held_by_autograd`), found and cut
    #: loose by the first pass, before any storage is emptied.
    cut: int | None = None


def to_the_end(step: Callable[[], None]) -> BaseException | None:
    """Run ``step`` to its end through Ctrl-C (KeyboardInterrupt, SystemExit: a
    BaseException that is not an Exception), running it again after each; returns the
    first interrupt, for the caller to raise once done. An Exception is raised at once.

    ``step`` resumes where an interrupted pass stopped, and never waits for long: each
    pass makes progress. Ctrl-C midway through a release left a module half on meta:
    neither usable nor released, and its owner could not tell (auto took it as loaded,
    and every later call failed)."""
    interrupt: BaseException | None = None
    while True:
        try:
            step()
            return interrupt
        except Exception:
            raise
        except BaseException as exc:
            interrupt = interrupt or exc


def _release(
    module: nn.Module,
    name: str | None,
    stage: str | None,
    keep: list[nn.Module],
    done: _Progress,
) -> None:
    """:func:`release`'s work, with calls of ``module`` from other threads held back; what
    it did goes in ``done``, so a second pass finishes an interrupted one."""
    import torch

    kept_modules: set[int] = set()
    kept_storage: set[tuple[str, int]] = set()
    for other in keep:
        for sub in other.modules():
            kept_modules.add(id(sub))
        for t in _tensors(other):
            if not t.is_meta:
                kept_storage.add(_storage_key(t))

    registry = HookRegistry.of(module)
    retained = _retained(module)
    if done.cut is None:  # before any storage is emptied: a tensor tied to it may be held
        drop_autocast_casts()
        _cut_from_autograd(module, kept_storage, kept_modules, done, retained)
    freed, replaced = done.freed, done.replaced
    with torch.no_grad():
        for sub in module.modules():
            if id(sub) in kept_modules:
                continue
            named = [
                *sub.named_parameters(recurse=False, remove_duplicate=False),
                *sub.named_buffers(recurse=False, remove_duplicate=False),
            ]
            for key, t in named:
                if t.is_meta or id(t) in retained:
                    continue
                skey = _storage_key(t)
                if skey in kept_storage:
                    continue
                if id(t) in replaced:  # a tied weight already done under another name
                    twin = replaced[id(t)][1]
                    if twin is not t:
                        setattr(sub, key, twin)
                    continue
                storage = t.untyped_storage()
                first = skey not in freed
                if first:
                    freed[skey] = storage.nbytes()
                    done.devices.add(t.device.type)
                    done.storages.append(storage)
                twin, old = _to_meta(sub, key, t)
                replaced[id(t)] = (t, twin)
                if first:
                    _empty_storage(old)
            # A part released before (a streamed block) now says this release.
            HookRegistry.attach(sub).add(RELEASED, ReleasedHook(name, stage, module), replace=True)
    for hook in registry.hooks() if registry is not None else ():
        hook.released(module)  # after the tensors went: a staged placeholder marks them


def drop_autocast_casts() -> None:
    """Empty ``torch.autocast``'s cache of low-precision casts (a no-op outside autocast,
    whose exit empties it). In torch 2.13 the cache is one for the process: a release on
    any thread drops the casts every thread made.

    Inside autocast the cache holds each float32 weight it cast (a reference
    :func:`held_by_autograd` counts) and its cast copy, until the block ends: a pipeline
    called under ``torch.autocast`` warned at every release that an autograd graph held
    the weights, and the copies of weights released (keyed by tensors never used again)
    piled up at each reload, about 1 MiB per call of the tiny Stable Diffusion. Dropped,
    the weights still in use are cast again at their next use, to the same values."""
    import torch

    torch.clear_autocast_cache()


def _cut_from_autograd(
    module: nn.Module,
    kept_storage: set[tuple[str, int]],
    kept_modules: set[int],
    done: _Progress,
    retained: set[int],
) -> None:
    """Make a backward that needs ``module``'s weights raise instead of reading them freed.

    Each tensor the release takes that autograd holds (:func:`held_by_autograd`) gets a new
    version: a graph that saved it or a view of it (which shares its version) fails
    autograd's own check when it unpacks it, before any kernel reads the memory. Freed
    under it, a backward failed deep in a kernel ('weight of shape [0]') or crashed the
    interpreter (a convolution's). Only those: the diffusers adapter reads the versions
    of the tensors it tracks (a tensor another module ties to is tracked as one), and a
    new version is an edit to it. Records in ``done`` the bytes so held, for the warning.
    """
    done.cut = _autograd_held(module, kept_storage, kept_modules, cut=True, retained=retained)


def _to_meta(sub: nn.Module, key: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Make ``sub.key`` (the tensor ``t``) a meta tensor. Returns (the meta tensor now at
    ``sub.key``, a tensor holding the old storage, to be emptied). The object ``t`` itself
    becomes the meta tensor where torch allows (``swap_tensors``), so an adapter can track
    a tensor by identity for the module's life; else a meta twin takes its place."""
    import torch

    twin = _meta_twin(t)
    try:
        torch.utils.swap_tensors(t, twin)
        return t, twin  # twin now holds the old storage
    except RuntimeError:  # held elsewhere (a weakref, a view)
        # nn.Module.__setattr__ puts a Parameter into the parameters and a tensor under a
        # buffer's name into the buffers, keeping its persistence.
        setattr(sub, key, twin)
        return twin, t


def _meta_twin(t: torch.Tensor) -> torch.Tensor:
    import torch
    from torch import nn

    with torch.inference_mode(t.is_inference()):  # is_inference() answers as it did
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            return nn.Parameter(meta, requires_grad=t.requires_grad)
        return meta


def _empty_storage(t: torch.Tensor) -> None:
    """Free ``t``'s storage in place, even while other code holds ``t``."""
    import torch

    # Resizing the storage to 0 frees it for every tensor that views it. Storage that
    # cannot be resized (safetensors' load_file, numpy-backed, mmapped files) is dropped
    # from this tensor instead, so it goes as soon as no other view holds it. Neither needs
    # a gc.collect() (release() runs one afterwards for other garbage, once per batch).
    storage = t.untyped_storage()
    if storage.device.type == "cpu":
        forget_huge_pages(storage.data_ptr(), storage.nbytes())
    try:
        storage.resize_(0)
    except RuntimeError:
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def unmark_released(module: nn.Module) -> None:
    """Take :func:`release`'s hook off this one module (not its children): for loaders
    that refill a released module in place, which is live again afterwards."""
    HookRegistry.remove(module, RELEASED)


# -- transparent huge pages ------------------------------------------------------------------
_HUGE = 2 << 20  # x86-64 and arm64 transparent huge page size
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    if not sys.platform.startswith("linux") or not _huge_pages_on_advice():
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=1)
def _huge_pages_on_advice() -> bool:
    """Whether the kernel gives transparent huge pages where advised only (mode
    ``[madvise]``). Under ``always`` they come unasked, and advice would only add the
    synchronous compaction that ``defrag=madvise`` does on an advised fault."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def _advise(ptr: int, nbytes: int, advice: int) -> None:
    madvise = _madvise()
    if madvise is None:
        return
    start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
    end = (ptr + nbytes) & ~(_HUGE - 1)
    if end - start >= _HUGE:
        madvise(start, end - start, advice)  # advice only: a failure changes nothing


def advise_huge_pages(ptr: int, nbytes: int) -> None:
    """Ask for transparent huge pages on the 2 MiB-aligned inside of a fresh allocation
    (Linux, THP mode ``madvise``; elsewhere nothing).

    One fault then maps 2 MiB instead of 4 KiB. torch does the same under
    ``THP_MEM_ALLOC_ENABLE=1``, which a library cannot set for its users. The advice marks
    the address range, not the allocation: :func:`release` takes it back before freeing
    (:func:`forget_huge_pages`).
    """
    _advise(ptr, nbytes, _MADV_HUGEPAGE)


def forget_huge_pages(ptr: int, nbytes: int) -> None:
    """Take huge-page advice off memory about to be freed.

    malloc keeps freed memory mapped and hands it out again; advised, every later
    allocation there (the caller's own tensors, a later load into plain pages) would fault
    huge pages, compacting memory on the fault: the advice would outlive the weights
    (docs/load.md: loads ahead into plain pages reusing advised memory, 9-10 of 37 over
    0.25 s with the advice left, 1-2 with it taken back). In THP mode ``madvise`` memory
    never advised gets no huge pages either, so this changes nothing for it; torch's own
    advice (``THP_MEM_ALLOC_ENABLE``) overrides it on reuse.
    """
    _advise(ptr, nbytes, _MADV_NOHUGEPAGE)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # here, not at the top: ctypes.util costs ~15 ms of `import stageload`

    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim  # glibc only; musl has no malloc_trim
    except (OSError, AttributeError):
        return None


def return_memory_to_os(devices: Iterable[str] = ("cpu",), *, collect: bool = True) -> None:
    """Collect garbage, trim malloc's heap on glibc, and empty the CUDA and MPS caches.

    Freed tensors under glibc's mmap threshold (up to 32 MiB) stay in malloc's heap
    until ``malloc_trim(0)``; the CUDA and MPS allocators keep freed blocks cached.
    ``collect=False`` skips ``gc.collect()``, which costs ~0.15 s once torch is imported
    and is not needed when the storage was emptied in place, as :func:`release` does.
    """
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    torch = sys.modules.get("torch")
    if torch is None:
        return
    devices = set(devices)
    if "cuda" in devices and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if "mps" in devices and torch.backends.mps.is_available():
        torch.mps.empty_cache()
