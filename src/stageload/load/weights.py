"""Fill a module's weights from safetensors files at the speed of the disk.

Each destination tensor is allocated once, on the target device and dtype, and the file's
bytes are read straight into it with positioned reads (``os.preadv``) of large chunks from a
few threads; the reads release the GIL, so the threads overlap. No mmap and no second
full-size copy: the peak is the weights plus one bounce buffer per thread, and only where a
dtype conversion or an accelerator needs one. On a warm page cache the limit is the page
faults on the fresh destination; advising transparent huge pages for it (``madvise``) cuts
them 512-fold (bench/results/load/).

Which thread touches what: the calling thread plans the load, allocates every destination
and puts the results into the module; the worker threads only write into destinations that
no one else sees yet, each its own byte range. The module changes only after every read
succeeded; on any failure it is released (:func:`stageload.release`) instead of being left
half filled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..external import non_persistent_buffers, own_tensor_tables, written_in_place
from ..hooks.release import advise_huge_pages, release, unmark_released
from .checkpoint import (
    DTYPES,
    CheckpointError,
    Entry,
    check_unchanged,
    checkpoint_bytes,
    checkpoint_files,
    file_stamps,
    given_paths,
    read_entries,
)
from .loaders import check_build, rng_free
from .placement import COPIED, Placement, empty_at
from .progress import progress as progress_bar
from .reader import in_background, run_chunks

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CheckpointError",
    "LoadPlan",
    "Target",
    "checkpoint_bytes",
    "default_threads",
    "fill",
    "from_safetensors",
    "install",
    "load_weights",
    "plan",
    "put",
    "read",
    "targets",
]

Files = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]

#: Bytes per read. 16 MiB: large enough for the disk's full speed.
CHUNK = 16 << 20
#: All threads' bounce buffers together (conversions, accelerators) stay within this.
BOUNCE_BUDGET = 64 << 20
# How destinations on the CPU are allocated: "thp" (torch.empty, huge pages advised) or
# "plain" (torch.empty as is); STAGELOAD_HUGE_PAGES=0 picks "plain". Huge pages won 2x on a
# quiet machine, but cost up to 2x where memory is fragmented (the kernel compacts on the
# fault): bench/results/load/.
_ALLOC = "plain" if os.environ.get("STAGELOAD_HUGE_PAGES") == "0" else "thp"


def default_threads() -> int:
    """Reader threads per load when the caller names none."""
    # Cold reads want several requests in flight; warm ones are bound by page faults and
    # copies, which scale with cores. 4 was best on the 2-core bench machine.
    return max(4, min(8, os.cpu_count() or 4))


@dataclass
class Target:
    """One tensor of the module (all the names it goes by, tied ones included)."""

    tensor: torch.Tensor
    places: list[tuple[nn.Module, str]] = field(default_factory=list)  # (submodule, key)
    names: list[str] = field(default_factory=list)
    persistent: bool = True


def load_weights(
    module: nn.Module,
    files: Files,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    threads: int | None = None,
    name: str | None = None,
    progress: bool = True,
    placement: Placement = COPIED,
) -> int:
    """Fill every parameter and buffer of ``module`` from safetensors files; return the bytes.

    Args:
        module: built on the ``meta`` device, or materialised (then each tensor already on
            the target device and dtype is overwritten in place; others are replaced).
        files: a ``.safetensors`` file, a sharded ``*.safetensors.index.json``, a folder
            holding either, or a list of files.
        device: where the weights go (default CPU). CUDA and MPS go through pinned buffers.
        dtype: the dtype floating point tensors load as; default: each tensor's dtype in
            ``module``. Integer and bool tensors keep theirs.
        strict: missing and unexpected keys are an error (listed together, with the files).
            Shape mismatches are an error either way.
        threads: reader threads (default 4 to 8, by core count).
        name: what the progress bar calls the model (default: its class name).
        progress: False never shows a bar. Otherwise a load of over a GiB shows one on
            stderr when it is a terminal or ``STAGELOAD_PROGRESS=1`` (``0``: never), except
            on the prefetch thread (``stageload.load.progress``).
        placement: where each new CPU tensor starts, mod 64, as the loader you compare
            with puts it (:mod:`stageload.load.placement`): ``COPIED`` (default) as
            ``load_state_dict`` into a module built on the CPU, ``MAPPED`` as safetensors'
            ``load_file`` and ``from_pretrained`` (up to 64 bytes more per tensor). Kernels
            may round differently for differently aligned inputs.

    Tied weights (one tensor under several names) stay one tensor. On failure ``module``
    is released, so it cannot be used half filled; the error names the file.
    """
    return fill(
        module,
        files,
        device=device,
        dtype=dtype,
        strict=strict,
        threads=threads,
        name=name,
        progress=progress,
        placement=placement,
    )


def fill(
    module: nn.Module,
    files: Files,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    threads: int | None = None,
    placement: Placement = COPIED,
    names: Mapping[str, str] | None = None,
    only_empty: bool = False,
    unused_ok: bool = False,
    name: str | None = None,
    progress: bool = True,
) -> int:
    """:func:`load_weights`, plus what adapters that refill a module need (``load.refill``).

    ``placement``: where the new CPU tensors start (:mod:`.placement`). ``names``: the
    tensors to fill (others
    are left alone), each name -> its key in the checkpoint (peft moves ``to_q.weight``
    to ``to_q.base_layer.weight``). ``only_empty``: fill only the tensors on ``meta``; the
    others (a user's changes, kept in memory) stay as they are. ``unused_ok``: checkpoint
    tensors the module no longer has (a submodule the user replaced) are not an error.
    """
    import torch
    from torch import nn

    if not isinstance(module, nn.Module):
        raise TypeError(f"load_weights() expects an nn.Module, got {type(module).__name__}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    target_device = torch.device(device) if device is not None else torch.device("cpu")
    paths = checkpoint_files(files)
    try:
        entries = read_entries(paths)
        found = targets(module)
        if names is not None:  # the others are the caller's own (a LoRA's): left alone
            found = [t for t in found if not t.persistent or names.keys() & set(t.names)]
        planned = plan(
            found,
            entries,
            paths,
            strict=strict,
            names=names,
            only_empty=only_empty,
            unused_ok=unused_ok,
        )
        with torch.no_grad():
            results, nbytes = read(
                planned,
                target_device,
                dtype,
                threads or default_threads(),
                placement,
                (name or type(module).__name__, progress),
            )
            install(module, planned, results, target_device, dtype, strict)
    except BaseException:
        release(module)
        raise
    return nbytes


def from_safetensors(
    build: Callable[[], nn.Module], files: Files, **kwargs: Any
) -> Callable[[], nn.Module]:
    """A zero-argument loader for :class:`~stageload.StagedModels`: build, then load.

    ``build()`` runs under ``torch.device("meta")``, so the structure costs no memory and
    its initialisers draw no random numbers; then :func:`load_weights` fills it from
    ``files`` (``kwargs``: ``device``, ``dtype``, ``strict``, ``threads``, ``name``,
    ``progress``, ``placement``). Buffers that ``build`` computes rather than the
    checkpoint holding them (non-persistent buffers) have no values on ``meta``: strict
    mode names them; build such modules yourself and call :func:`load_weights`.

    Example::

        models = StagedModels({"unet": from_safetensors(lambda: UNet(cfg), "unet.safetensors",
                                                        dtype=torch.bfloat16)}, stages=...)
    """
    check_build(build, "from_safetensors")
    unknown = set(kwargs) - {
        "device",
        "dtype",
        "strict",
        "threads",
        "name",
        "progress",
        "placement",
    }
    if unknown:
        raise TypeError(f"from_safetensors() got unexpected keyword(s) {sorted(unknown)!r}")
    # The paths of the call: a script that changes its directory before the first load
    # must not read other files (a list is read once: an iterator could not be read twice).
    files = [path.absolute() for path in given_paths(files)]
    first: dict[Path, Any] = {}  # the files' stamps when the first load read them

    def load() -> nn.Module:
        import torch
        from torch import nn

        check_unchanged(
            first,
            "since this loader first read it: a reload would give other weights than the "
            "ones released",
            fix="restore the file, or make a new loader (from_safetensors) to read it",
        )
        # Before the read: a change during it shows. Sampled for the stamps kept (the first).
        stamps = file_stamps(checkpoint_files(files), sampled=not first)
        with torch.device("meta"):
            module = build()
        if not isinstance(module, nn.Module):
            raise TypeError(f"build() returned {type(module).__name__}, not an nn.Module")
        load_weights(module, files, **kwargs)
        if not first:
            first.update(stamps)
        return module

    name = getattr(build, "__qualname__", type(build).__name__)
    load.__qualname__ = f"from_safetensors({name})"
    # Built on meta and filled by reads: it draws no random numbers, so StagedModels may
    # prefetch it on a background thread (stageload.rng_free).
    rng_free(load)
    return load


# -- planning ---------------------------------------------------------------------------------
def named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` under every name it has: its parameters
    then its buffers, each in ``named_parameters(remove_duplicate=False)`` order. One walk
    of the submodules, not two (a load and a release ask several times)."""
    params: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        own_params, own_buffers = own_tensor_tables(sub)
        params.extend((dot + k, p) for k, p in own_params.items() if p is not None)
        buffers.extend((dot + k, b) for k, b in own_buffers.items() if b is not None)
    return params + buffers


def targets(module: nn.Module) -> list[Target]:
    """Every tensor of ``module`` once, with all its names (tied ones share a target)."""
    by_id: dict[int, Target] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        computed = non_persistent_buffers(sub)
        own = [
            *sub.named_parameters(recurse=False, remove_duplicate=False),
            *sub.named_buffers(recurse=False, remove_duplicate=False),
        ]
        for key, t in own:
            target = by_id.setdefault(id(t), Target(t))
            target.places.append((sub, key))
            target.names.append(f"{prefix}.{key}" if prefix else key)
            if key in computed:
                target.persistent = False
    return list(by_id.values())


@dataclass
class LoadPlan:
    """One load, planned from the headers: the module's targets, and those to read, each
    with the checkpoint entry it reads from. :func:`plan` makes it, :func:`read` reads
    it into fresh tensors (any thread: it touches no module), :func:`install` puts them in
    (the thread that owns the module)."""

    targets: list[Target]
    reads: list[tuple[Target, Entry]]


def plan(
    targets: list[Target],
    entries: dict[str, Entry],
    paths: list[Path],
    *,
    strict: bool = True,
    names: Mapping[str, str] | None = None,
    only_empty: bool = False,
    unused_ok: bool = False,
    strict_hint: bool = True,
) -> LoadPlan:
    """Each of ``targets`` (from :func:`targets`) with the checkpoint entry it loads from;
    missing, unexpected and mismatched keys raise one ``ValueError`` naming ``paths`` (see
    :func:`fill` for ``names``, ``only_empty`` and ``unused_ok``). ``strict_hint``: the
    caller takes ``strict=False``, so the error may offer it."""
    reads: list[tuple[Target, Entry]] = []
    used: set[str] = set()
    missing: list[str] = []
    valueless: list[str] = []  # missing and on meta
    mismatched: list[str] = []
    names = names or {}
    for target in targets:
        if not target.persistent:
            continue
        found = [k for k in (names.get(n, n) for n in target.names) if k in entries]
        used.update(found)
        if only_empty and not target.tensor.is_meta:
            continue  # kept as it is; its checkpoint entry, if any, is accounted for
        if not found:
            missing.append(target.names[0])
            if target.tensor.is_meta:
                valueless.append(target.names[0])
            continue
        # A tied tensor stored under several of its names: the last one, as load_state_dict
        # leaves it (it copies each name in turn); the first gave other weights when the
        # stored values differ.
        key = found[-1]
        entry = entries[key]
        if entry.shape != tuple(target.tensor.shape):
            mismatched.append(
                f"{key}: {list(entry.shape)} in {entry.file.name}, "
                f"{list(target.tensor.shape)} in the module"
            )
            continue
        reads.append((target, entry))
    unexpected = [f"{k} ({e.file.name})" for k, e in entries.items() if k not in used]
    problems = []
    if mismatched:
        problems.append(_listing("shape mismatch", mismatched))
    skippable = len(problems)
    if strict and missing:
        problems.append(_listing("missing from the checkpoint", missing))
    if strict and unexpected and not unused_ok:
        problems.append(_listing("unexpected (not in the module)", unexpected))
    if not strict and valueless:  # strict=False keeps a missing tensor's value: it has none
        problems.append(
            _listing("missing from the checkpoint, and on meta: no value to keep", valueless)
        )
    if problems:
        where = ", ".join(str(p) for p in paths)
        fix = "build the module with the checkpoint's config"
        if valueless and not strict:
            fix = (
                "strict=False keeps the values that missing tensors have; pass every file "
                "that holds them in one call (a list), or build the module on the CPU "
                "(from_safetensors builds it on meta) and call load_weights() on it"
            )
        elif strict_hint and len(problems) > skippable and not mismatched:
            fix += ", or pass strict=False to skip missing and unexpected keys"
        listed = "\n".join(problems)
        raise ValueError(f"the checkpoint does not fit the module ({where}):\n{listed}\n{fix}")
    return LoadPlan(targets, reads)


def _listing(what: str, names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit]) + (
        f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    )
    return f"  {len(names)} {what}: {shown}"


# -- reading ----------------------------------------------------------------------------------
def read(
    planned: LoadPlan,
    device: torch.device,
    dtype: torch.dtype | None,
    threads: int,
    placement: Placement = COPIED,
    bar: tuple[str, bool] = ("", False),
) -> tuple[dict[int, torch.Tensor], int]:
    """Allocate every destination of ``planned`` and fill it; returns {id(target): tensor}
    and the bytes. Touches no module: a read ahead runs it on its own thread.

    ``bar``: the model's name and whether a progress bar may show (:mod:`.progress`).
    """
    import torch

    threads = min(threads, max(1, sum(-(-e.nbytes // CHUNK) for _, e in planned.reads)))
    bounce = min(CHUNK, max(1 << 20, BOUNCE_BUDGET // threads))
    fds: dict[Path, int] = {}
    results: dict[int, torch.Tensor] = {}
    jobs: list[tuple[int, Path, int, int, torch.Tensor, int, torch.dtype | None]] = []
    total = 0
    try:
        for target, entry in planned.reads:
            old = target.tensor
            want = dtype if dtype is not None and old.is_floating_point() else old.dtype
            src = getattr(torch, DTYPES[entry.dtype][0])
            dst = _destination(old, want, device, placement.misalign(entry, want, device))
            results[id(target)] = dst
            total += dst.nbytes
            if entry.file not in fds:
                fds[entry.file] = os.open(entry.file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            # Direct reads need the file's bytes to be the destination's bytes on the CPU.
            direct = device.type == "cpu" and src == want
            convert = None if direct else src
            step = CHUNK if direct else bounce
            step -= step % entry.itemsize
            for start in range(0, entry.nbytes, step):
                n = min(step, entry.nbytes - start)
                jobs.append(
                    (fds[entry.file], entry.file, entry.offset + start, n, dst, start, convert)
                )
        jobs.sort(key=lambda j: (str(j[1]), j[2]))  # file order: sequential runs per thread
        # The bar counts bytes read from the checkpoint, the size that sets the load's time.
        read = sum(j[3] for j in jobs)
        with progress_bar(bar[0], read, allowed=bar[1]) as on_bytes:
            run_chunks(jobs, device, min(threads, max(1, len(jobs))), bounce, on_bytes)
    finally:
        for fd in fds.values():
            os.close(fd)
    return results, total


def _destination(
    old: torch.Tensor, dtype: torch.dtype, device: torch.device, misalign: int = 0
) -> torch.Tensor:
    """The tensor the bytes go into: ``old`` itself when it can be overwritten in place.

    ``misalign``: the new tensor's address mod 64 on the CPU (:mod:`.placement`); a
    tensor overwritten in place stays where it is, as ``load_state_dict`` leaves it.
    """
    import torch

    if (
        not old.is_meta
        and old.device == device
        and old.dtype == dtype
        and old.is_contiguous()
        and old.storage_offset() == 0
        and old.untyped_storage().nbytes() == old.nbytes
    ):
        return old.detach()
    if device.type != "cpu":
        dst = torch.empty(old.shape, dtype=dtype, device=device)
    else:
        dst = empty_at(tuple(old.shape), dtype, misalign)
    # Not for a load ahead: a huge-page fault may stop to compact memory, and on this VM a
    # third of the loads ahead then took over 0.25 s (90th percentile 0.40 s, plain: 1 %,
    # 0.17 s), longer than the stage they were to hide behind, and the cost model, timing
    # them, skipped prefetches that paid (bench/results/residency/tail.md). On demand the
    # load is what the caller waits for, and huge pages made a warm 1 GiB load 1.25x faster
    # (3.17 against 2.52 GB/s, bench/results/load/warm-thp-vs-plain.md).
    if device.type == "cpu" and _ALLOC == "thp" and not in_background():
        advise_huge_pages(dst.data_ptr(), dst.nbytes)
    return dst


# -- installing -------------------------------------------------------------------------------
def put(target: Target, new: torch.Tensor) -> None:
    """Give ``target``'s tensor object the contents of ``new``, under every name it has.

    The module keeps its own tensor objects (tied weights stay tied, and an adapter can
    tell a tensor by its identity for the module's whole life), and no module method runs:
    a prefetch fills on a background thread, where ``nn.Module.register_parameter`` may be
    patched by another thread's ``from_pretrained`` (accelerate's ``init_empty_weights``
    moves every new parameter to meta, for every thread).
    """
    import torch

    value = like(target.tensor, new)
    try:
        torch.utils.swap_tensors(target.tensor, value)
    except RuntimeError:  # held elsewhere (a weakref, a view): register the new one instead
        place(target, value)


def place(target: Target, value: torch.Tensor) -> None:
    """Make ``value`` the target's tensor, as a new object under every name it has.

    Written into the module's tables, not through ``setattr``: that runs
    ``nn.Module.register_parameter``, which accelerate's ``init_empty_weights`` patches
    for every thread while another thread's ``from_pretrained`` builds on meta (the new
    weight went to meta)."""
    for sub, key in target.places:
        params, buffers = own_tensor_tables(sub)
        (params if key in params else buffers)[key] = value
    target.tensor = value


def like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` as the same kind of tensor as ``old``: a Parameter (with ``old``'s
    ``requires_grad``) for a Parameter, a plain tensor for a buffer."""
    from torch import nn

    if isinstance(old, nn.Parameter) and not isinstance(new, nn.Parameter):
        return nn.Parameter(new, requires_grad=old.requires_grad)
    if not isinstance(old, nn.Parameter) and isinstance(new, nn.Parameter):
        return new.detach()
    return new


def install(
    module: nn.Module,
    planned: LoadPlan,
    results: dict[int, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype | None,
    strict: bool,
) -> None:
    """Put the tensors :func:`read` returned into ``module`` (the planned targets'); one
    object per tied group keeps it tied. A released module filled again is live again."""

    unfilled: list[str] = []
    in_place: list[torch.Tensor] = []
    for target in planned.targets:
        old = target.tensor
        new = results.get(id(target))
        if new is None:
            if old.is_meta:
                unfilled.append(target.names[0])
                continue
            want = dtype if dtype is not None and old.is_floating_point() else old.dtype
            new = old.detach().to(device=device, dtype=want)  # computed buffer: move it
        if not old.is_meta and new.data_ptr() == old.data_ptr():
            if id(target) in results:
                in_place.append(old)  # filled in place
            continue  # else left as it was (only_empty: a tensor the caller put in)
        put(target, new)
    # Written through its memory, not by torch: a graph that saved the old values must know
    # (backward raises, as after load_state_dict's copy_; it used the new ones, silently).
    written_in_place(in_place)
    if unfilled and strict:
        raise ValueError(
            _listing(
                "tensors still on meta (non-persistent buffers that build() computes)", unfilled
            )
            + "\nthe checkpoint cannot hold them; build the module on the CPU and call "
            "load_weights() on it"
        )
    for sub in module.modules():
        unmark_released(sub)  # a released module filled again is live again
