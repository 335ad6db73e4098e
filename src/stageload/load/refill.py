"""Reload a released module in place the way a reference loader filled it, at read speed.

An adapter's first load of a model goes through the model's own loader (``from_pretrained``):
it is the reference. It shows what no checkpoint header tells: the dtype each tensor ends up
in (modules kept in float32), the values of buffers computed in ``__init__`` rather than
stored, where the weights sit in memory, and whether the checkpoint's keys and values reach
the model unchanged. :func:`learn` checks that last point against the files: every key of
the module found in the checkpoint, no key left over (renames), and the first bytes of each
tensor equal to the file's (conversions that keep the keys). Only then are later loads done
in place by :func:`reload`: the released module's meta tensors get back the reference's
dtypes, its computed buffers their recorded values, and :func:`~stageload.load_weights`
reads the files straight into it. Otherwise the adapter keeps its loader and says why.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..hooks.release import release
from .checkpoint import DTYPES, Stamp, check_unchanged, file_stamps, read_entries
from .placement import Placement
from .weights import fill, place, plan, put, targets

if TYPE_CHECKING:
    import torch
    from torch import nn

_PROBE = 4096  # bytes compared per tensor at the first load
_CHUNK = 1 << 20  # bytes read and compared at a time (8 MiB put 12 MiB, 2.7 %, on auto's peak)


@dataclass
class Recipe:
    """What :func:`reload` needs, learned from the reference load."""

    files: list[Path]
    # Keyed by checkpoint key (a computed buffer: its first name in the module then).
    dtypes: dict[str, torch.dtype]  # each tensor's dtype after loading
    computed: dict[str, torch.Tensor]  # non-persistent buffers, on the CPU
    # Where the reference put each tensor (address mod 64): kernels may round differently
    # for differently aligned inputs; a Flux transformer staged here differed from eager in
    # the last bit without it (stageload.load.placement).
    placement: Placement
    # The files as they were when the reference load read them: a reload from files
    # replaced or rewritten since would give other weights, silently.
    stamps: dict[Path, Stamp | None]
    # Each tensor's checkpoint key by its name, where the loader mapped them (learned
    # with ``made_new``); empty: every name is its key.
    names: dict[str, str] = field(default_factory=dict)
    # The checkpoint keys whose tensors the reference load left mapped from the file (a
    # transformers model whose dtype needs no conversion, on a CPU): a reload maps them
    # again, so they stay page cache the footprint does not count, as without stageload
    # (read into the process's own memory, auto's reloads outgrew the script alone).
    mapped: frozenset[str] = frozenset()


def learn(
    module: nn.Module,
    files: list[Path],
    names: Mapping[str, str] | None = None,
    *,
    whole: bool = False,
    made_new: bool = False,
) -> Recipe | str:
    """Check a freshly loaded ``module`` against ``files``.

    Returns the :class:`Recipe` that :func:`reload` refills it with later, or the reason
    later loads cannot read the files directly. The caller keeps the recipe. ``names``, if
    given, maps the name of every tensor that comes from the checkpoint to its key there
    (peft renames ``to_q.weight`` to ``to_q.base_layer.weight``); tensors it leaves out (a
    LoRA's) are the caller's to keep in memory. ``whole`` compares every byte of each
    tensor with the file's, not only the first 4 KiB: for a loader nobody here knows (a
    user's factory may change a weight anywhere after reading it), at the cost of reading
    the checkpoint once more.

    ``made_new``: the loader may map names across the model's base prefix and make
    tensors the checkpoint lacks, as transformers' ``from_pretrained`` does for a base
    model's checkpoint loaded with a head (``bert.`` added to each name, a new
    ``classifier``): the mapping is learned (:attr:`Recipe.names`), and the new tensors'
    values are kept, as computed buffers are, while they are at most
    :data:`NEW_KEPT` of the model's bytes (else the reason why not).
    """
    stamps = file_stamps(files, sampled=True)  # before the checks: a change during them shows later
    new: list[Any] = []
    learned: dict[str, str] = {}
    try:
        entries = read_entries(files)
        found = targets(module)
        if made_new and names is None:
            mapped = _prefixed(module, found, entries)
            if isinstance(mapped, str):
                return mapped
            if mapped is not None:
                names, new = mapped
                learned = names
                kept = sum(t.tensor.nbytes for t in new)
                total = sum(t.tensor.nbytes for t in found)
                if kept > NEW_KEPT * total:
                    return (
                        f"{len(new)} of its tensors ({kept} of {total} bytes) are not in the "
                        f"checkpoint, made new by the loader: "
                        + ", ".join(t.names[0] for t in new[:5])
                        + (", ..." if len(new) > 5 else "")
                    )
        if names is not None:
            found = [t for t in found if not t.persistent or set(t.names) & names.keys()]
        names = names or {}
        # A checkpoint tensor the module does not hold is never read (a config with fewer
        # layers, a head from_pretrained dropped); one the module holds and the files
        # lack under its name, or in another shape, means the loader changed it.
        planned = plan(found, entries, files, names=names, unused_ok=True)
    except ValueError as exc:
        listed = [line.strip() for line in str(exc).splitlines() if line.startswith("  ")]
        # Not a fault: transformers adds a prefix to a base model's names when it loads
        # one into a model with a head (BERT's checkpoint into a classifier) and makes
        # the head new; a loader may rename or reshape as it likes.
        return (
            "the checkpoint does not hold its tensors as the loader made them (names mapped "
            "or layers made new on load, as a checkpoint without a head loaded with one): "
            + "; ".join(listed)
        )
    for target, entry in planned.reads:
        tensor = target.tensor
        probe = entry.nbytes if whole else _PROBE
        if tensor.is_meta or not _same_start(tensor, entry, probe):
            return f"{target.names[0]!r} differs from the file's (converted on load?)"
    if any(not t.persistent and t.tensor.is_meta for t in found):
        return "it has computed buffers on meta"
    dtypes = {_key(t, names): t.tensor.dtype for t in found}
    # Computed buffers and the tensors the loader made new: their values, put back as
    # they were at each reload (the loader makes them the same from the same RNG state).
    computed = {
        _key(t, names): t.tensor.detach().to("cpu", copy=True)
        for t in [*(t for t in found if not t.persistent), *new]
    }
    placement = Placement.recorded({entry: target.tensor for target, entry in planned.reads})
    ranges = mapped_ranges({entry.file for _, entry in planned.reads})
    mapped = frozenset(
        _key(target, names)
        for target, entry in planned.reads
        if any(lo <= target.tensor.data_ptr() < hi for lo, hi in ranges.get(entry.file, ()))
    )
    return Recipe(list(files), dtypes, computed, placement, stamps, learned, mapped)


def mapped_ranges(files: Iterable[Path]) -> dict[Path, list[tuple[int, int]]]:
    """The address ranges this process maps from each of ``files`` (``/proc/self/maps``;
    none where there is no such file: not Linux)."""
    wanted = {str(Path(f).resolve()): Path(f) for f in files}
    ranges: dict[Path, list[tuple[int, int]]] = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path in wanted:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    ranges.setdefault(wanted[path], []).append((lo, hi))
    except OSError:
        return {}
    return ranges


def _map(module: nn.Module, recipe: Recipe, names: Mapping[str, str] | None) -> None:
    """Map the recipe's mapped tensors of ``module`` (on ``meta``) from their files, as the
    reference load had them: the same bytes at the same alignment (one private mapping a
    file, as safetensors': a write by the script copies the page). Mapped here, not
    through safetensors' ``get_tensor``: that kept about 28 bytes a tensor for good (a
    long run of reloads grew 2.3 MiB in 1,200), and a Ctrl-C inside it came out as a
    ValueError. Each tensor is one of its own over the mapping (``torch.frombuffer``): a
    view of one tensor over the file would share its version with all the others, and
    auto reads a higher version as a write by the script."""
    import mmap

    import torch

    entries = read_entries(recipe.files)
    maps: dict[Path, mmap.mmap] = {}  # each file's; its tensors keep it, then it unmaps
    for target in targets(module):
        if not target.tensor.is_meta or not target.persistent:
            continue
        if names is not None and not names.keys() & set(target.names):
            continue  # the caller's own (a LoRA's)
        key = _key(target, names or {})
        entry = entries.get(key)
        if key not in recipe.mapped or entry is None or not entry.nbytes:
            continue
        dtype = getattr(torch, DTYPES[entry.dtype][0])
        if dtype != recipe.dtypes.get(key) or entry.shape != tuple(target.tensor.shape):
            continue  # read and converted by fill, as the rest
        if entry.file not in maps:
            with open(entry.file, "rb") as file:
                # Python 3.13 can leave the descriptor closed once mapped; before it, the
                # map keeps one open while its tensors live.
                fd = {"trackfd": False} if sys.version_info >= (3, 13) else {}
                maps[entry.file] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY, **fd)
        count = entry.nbytes // entry.itemsize
        flat = torch.frombuffer(maps[entry.file], dtype=dtype, count=count, offset=entry.offset)
        put(target, flat.view(entry.shape))


#: The most of a model's bytes :func:`learn` keeps in memory for tensors its loader made
#: new (a classifier head on a base model's checkpoint); more, and the model reloads
#: through its loader.
NEW_KEPT = 1 / 8


def _prefixed(
    module: nn.Module, found: list[Any], entries: Mapping[str, Any]
) -> tuple[dict[str, str], list[Any]] | str | None:
    """Each persistent tensor's checkpoint key by its names, across the model's base
    prefix (``base_model_prefix``, transformers': ``bert``) where its own name is not in
    the checkpoint, and the tensors under no key at all; None when every tensor is under
    its own name (nothing mapped, nothing new); why not, when a tensor is in the
    checkpoint under both names (transformers picks one for the whole model)."""
    prefix = getattr(module, "base_model_prefix", "") or ""
    names: dict[str, str] = {}
    new: list[Any] = []
    for target in found:
        if not target.persistent:
            continue
        for name in target.names:
            keys = [key for key in (name, *_across(name, prefix)) if key in entries]
            if len(keys) > 1:  # the loader chose one for the whole model: not told here
                return f"the checkpoint holds {keys[0]!r} and {keys[1]!r}: which it read is unknown"
            if keys:
                names[name] = keys[0]
        if not set(target.names) & names.keys():
            new.append(target)
    if not new and all(key == name for name, key in names.items()):
        return None
    return names, new


def _across(name: str, prefix: str) -> tuple[str, ...]:
    """``name`` with the base prefix taken off, or put on."""
    if not prefix:
        return ()
    if name.startswith(prefix + "."):
        return (name[len(prefix) + 1 :],)
    return (f"{prefix}.{name}",)


def _key(target: Any, names: Mapping[str, str]) -> str:
    """The checkpoint key of ``target`` (its first name, mapped)."""
    return names.get(target.names[0], target.names[0])


def reload(
    module: nn.Module,
    recipe: Recipe,
    device: torch.device,
    names: Mapping[str, str] | None = None,
    *,
    convert: Callable[[nn.Module], Any] | None = None,
    name: str | None = None,
    progress: bool = True,
) -> None:
    """Fill the released tensors of ``module`` in place as its first load did (``recipe``
    from :func:`learn`; ``names`` as there); tensors still in memory stay.
    ``convert(module)`` then makes the conversions the model had since its first load (the
    script's ``.to(dtype)``) on what the files filled alone: the tensors that stayed in
    memory (the script's parts, ones it holds) had each when it was made, and are out of
    the module meanwhile, as are any left empty (converted again, a bfloat16 round trip
    would round them twice, and a ``state_dict()`` the script holds would lose them).
    ``name`` and ``progress``: the progress bar's, as for :func:`~stageload.load_weights`."""
    import torch

    kept = {id(t.tensor) for t in targets(module) if not t.tensor.is_meta}
    if recipe.names:  # the loader's mapping, after the script's renames (now -> at load)
        names = (
            dict(recipe.names)
            if names is None
            # a tensor the loader made new keeps its own name: its key in recipe.computed
            else {now: recipe.names.get(then, then) for now, then in names.items()}
        )
    check_unchanged(
        recipe.stamps,
        f"since {name or 'the model'} was first read from it: a reload would give other "
        f"weights than the ones released",
        fix="restore the file, or load the model again (from_pretrained) to use the new one",
    )
    if recipe.mapped and torch.device(device).type == "cpu":
        try:
            _map(module, recipe, names)
        except BaseException:  # Ctrl-C: whole or not at all, as fill
            release(module)
            raise
    with torch.no_grad():
        for target in targets(module):
            key = _key(target, names or {})  # not `name`: that is the model's, for the bar
            old = target.tensor
            if not old.is_meta:
                continue
            if key in recipe.computed:
                new = recipe.computed[key].clone()
            elif old.dtype != recipe.dtypes.get(key, old.dtype):
                new = torch.empty_like(old, dtype=recipe.dtypes[key], device="meta")
            else:
                continue
            put(target, new)
    fill(
        module,
        recipe.files,
        device=device,
        placement=recipe.placement,
        names=names,
        only_empty=True,
        strict=True,
        unused_ok=True,  # as learn: a submodule the user replaced leaves its keys unused
        name=name,
        progress=progress,
    )
    if convert is not None:  # the files' tensors only: not those in memory, nor any still empty
        with _aside([t for t in targets(module) if t.tensor.is_meta or id(t.tensor) in kept]):
            convert(module)


@contextlib.contextmanager
def _aside(aside: list[Any]) -> Iterator[None]:
    """Take the tensors of ``aside`` (targets) out of their module for the block: each
    place of theirs holds None, which conversions pass over (``nn.Module._apply`` skips a
    None parameter or buffer). Each is put back whatever ends the block: a Ctrl-C while
    they are taken out, too (putting back one still in its place changes nothing)."""
    tensors = [target.tensor for target in aside]
    try:
        for target in aside:
            place(target, None)
        yield
    finally:
        for target, tensor in zip(aside, tensors, strict=True):
            place(target, tensor)


#: Float dtypes that hold every value of the ones listed for them exactly.
_HOLDS = {"float64": ("float32", "float16", "bfloat16"), "float32": ("float16", "bfloat16")}


def converted(chain: Sequence[Any], dtype: Any) -> list[Any]:
    """``chain``, the dtypes a model's weights were converted to in order since they were
    read (each replayed at every later load: fp32 -> bf16 -> fp32 keeps bf16's rounding, as
    the script's weights do), after ``.to(dtype)``. A conversion back to a dtype the chain
    reached before, with only dtypes that hold its values exactly in between, changed no
    value since: the chain ends there instead of growing (SDXL's pipeline sends its VAE to
    float32 and back to float16 at every call)."""

    def holds(wide: Any, narrow: Any) -> bool:
        name = str(narrow).removeprefix("torch.")
        return wide == narrow or name in _HOLDS.get(str(wide).removeprefix("torch."), ())

    for i in range(len(chain) - 1, -1, -1):
        if chain[i] == dtype:
            if all(holds(d, dtype) for d in chain[i + 1 :]):
                return list(chain[: i + 1])
            break
    return [*chain, dtype]


def conversion_probes(
    fn: Callable[[Any], Any], dtypes: set[Any], device: Any
) -> dict[Any, Any] | None:
    """What ``fn`` (a conversion ``nn.Module._apply`` was given: ``.to``, ``.half``,
    ``.cuda``) makes of a tensor of each of ``dtypes`` on ``device``, so that a released
    model's conversion can be recorded and made at its loads. None where it does more than
    change dtypes and devices: shared memory (``share_memory()``), a memory format, probed
    on 4- and 5-dimensional tensors
    (channels_last strides differ from contiguous ones; a 1-element probe missed it, and
    the diffusers adapter dropped ``unet.to(memory_format=torch.channels_last)``). Raises
    what ``fn`` raises."""
    import torch

    out: dict[Any, Any] = {}
    for dtype in dtypes:
        for shape in ((1, 2, 1, 2), (1, 2, 1, 1, 2)):
            probe = torch.zeros(shape, dtype=dtype, device=device)
            got = fn(probe)
            if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
                return None
            if got.stride() != probe.stride() or got.is_shared():
                return None  # (shared memory: share_memory(), which needs the weights)
            out[dtype] = got
    return out


def fresh_memory(fn: Callable[[Any], Any], dtypes: set[Any], device: Any) -> set[Any]:
    """The dtypes among ``dtypes`` whose tensors on ``device`` ``fn`` (a conversion, as for
    :func:`conversion_probes`) copies to new memory though it keeps their dtype and device:
    ``.to("cpu:0")`` copies a CPU tensor (torch tells ``cpu:0`` from ``cpu``) where
    ``.to("cpu")`` gives it back, and the copy sits 64-byte aligned, not at the offset the
    load left it (accelerate's model offloading with ``device="cpu"`` moves each model
    to ``cpu:0`` at every call). Raises what ``fn`` raises."""
    import torch

    out: set[Any] = set()
    for dtype in dtypes:
        probe = torch.zeros(2, dtype=dtype, device=device)
        got = fn(probe)
        if (
            isinstance(got, torch.Tensor)
            and got.dtype == probe.dtype
            and got.device == probe.device
            and got.data_ptr() != probe.data_ptr()
        ):
            out.add(dtype)
    return out


def _same_start(tensor: torch.Tensor, entry: Any, probe: int) -> bool:
    """The first ``probe`` bytes of ``tensor`` equal the file's, converted to its dtype as
    torch does. Read and compared ``_CHUNK`` bytes at a time: a whole-tensor compare
    (``learn(whole=True)``) holds one chunk, not a copy of the tensor."""
    import torch

    src = getattr(torch, DTYPES[entry.dtype][0])
    n = min(entry.nbytes, probe - probe % entry.itemsize)
    if n == 0:
        return True
    flat = tensor.detach().reshape(-1)
    step = max(entry.itemsize, _CHUNK - _CHUNK % entry.itemsize)
    buffer = bytearray(min(step, n))  # one for every chunk, read into: no second copy
    with open(entry.file, "rb") as f:
        f.seek(entry.offset)
        for start in range(0, n, step):
            raw = memoryview(buffer)[: min(step, n - start)]
            if f.readinto(raw) != len(raw):
                return False
            expected = torch.frombuffer(raw, dtype=torch.uint8).view(src)
            first = start // entry.itemsize
            got = flat[first : first + expected.numel()].to("cpu")
            if got.dtype != expected.dtype:
                expected = expected.to(got.dtype)  # the conversion load_weights does
            if not torch.equal(got, expected):
                return False
    return True
