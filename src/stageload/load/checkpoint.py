"""Read safetensors headers (never the tensor data) and resolve checkpoint paths.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor's name to its dtype, shape and byte range, then the tensors' bytes. Everything the
loader needs to plan its reads, and every check a truncated or mismatched file fails, comes
from the header, so planning a load costs a few kilobytes of I/O. No torch import here:
``checkpoint_bytes`` serves the residency policy before any model is built.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import CheckpointError

INDEX_SUFFIX = ".index.json"
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000
# Offsets, dimensions and sizes are a Rust ``usize`` in safetensors: below 2**64.
_LIMIT = 1 << 64

#: safetensors dtype code -> (torch dtype name, bytes per element, is floating point).
DTYPES: dict[str, tuple[str, int, bool]] = {
    "F64": ("float64", 8, True),
    "F32": ("float32", 4, True),
    "F16": ("float16", 2, True),
    "BF16": ("bfloat16", 2, True),
    "F8_E4M3": ("float8_e4m3fn", 1, True),
    "F8_E5M2": ("float8_e5m2", 1, True),
    "I64": ("int64", 8, False),
    "I32": ("int32", 4, False),
    "I16": ("int16", 2, False),
    "I8": ("int8", 1, False),
    "U64": ("uint64", 8, False),
    "U32": ("uint32", 4, False),
    "U16": ("uint16", 2, False),
    "U8": ("uint8", 1, False),
    "BOOL": ("bool", 1, False),
}


@dataclass(frozen=True)
class Entry:
    """One tensor in a file: where its bytes are and what they hold."""

    file: Path
    offset: int  # absolute position in the file
    nbytes: int
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def is_floating(self) -> bool:
        return DTYPES[self.dtype][2]


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file, validated as safetensors validates them.

    The header is a JSON object of at most 100 MB inside the file; each tensor has a known
    dtype, a shape and two offsets that are non-negative integers below 2**64 (no floats,
    no ``1e400``), and a byte range of exactly dtype x shape; sorted by offset, the ranges
    start at 0, follow each other with no gap or overlap, and end where the file does.
    Anything else raises :class:`CheckpointError` naming the file and the tensor, before a
    byte of tensor data is trusted: a shifted or overlapping range would fill a module with
    another tensor's bytes.
    """
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path, f"only {size} bytes long, shorter than a header")
            length = int.from_bytes(head, "little")
            if length > _MAX_HEADER:
                # No header is that long: a file of another kind, named if it is a known
                # one (a cut-off safetensors file can start with any byte, so only now).
                other = _other_format(head + f.read(16))
                if other is not None:
                    raise CheckpointError(path, f"not safetensors but {other[0]}", fix=other[1])
            if length > min(_MAX_HEADER, size - 8):
                raise CheckpointError(
                    path,
                    f"header length {length} exceeds the file's {size} bytes"
                    if length <= _MAX_HEADER
                    else f"header length {length} exceeds safetensors' limit of {_MAX_HEADER}",
                )
            raw = f.read(length)
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint file at {str(path)!r}") from None
    header = _parse(path, raw)
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            _check_metadata(path, info)
            continue
        entries[name] = _entry(path, name, info, 8 + length)
    _check_ranges(path, entries, 8 + length, size - 8 - length)
    return entries


#: The first bytes of files often passed for safetensors: what each is, and what to do.
_OTHER_FORMATS = (
    (
        b"PK\x03\x04",
        "a PyTorch checkpoint (torch.save, a zip archive)",
        "convert it once: safetensors.torch.save_file(torch.load(path), 'model.safetensors')",
    ),
    (
        b"\x80",
        "a pickle (torch.save with the legacy format)",
        "convert it once: safetensors.torch.save_file(torch.load(path), 'model.safetensors')",
    ),
    (
        b"version https://git-lfs",
        "a Git LFS pointer: the weights were never downloaded",
        "run `git lfs pull` in the repository, or download the file itself",
    ),
    (b"GGUF", "a GGUF file (llama.cpp)", "use the model's safetensors weights"),
    (b"\x89HDF", "an HDF5 file (Keras)", "use the model's safetensors weights"),
)


def _other_format(head: bytes) -> tuple[str, str] | None:
    """What a file that starts with ``head`` is, and the fix, if it is a known other format."""
    for magic, what, fix in _OTHER_FORMATS:
        if head.startswith(magic):
            return what, fix
    return None


def _parse(path: Path, raw: bytes) -> dict[str, Any]:
    """The header's JSON object; numbers JSON cannot hold exactly and nesting past the
    parser's depth are errors naming the file, not ``OverflowError``/``RecursionError``."""

    def constant(word: str) -> Any:
        raise ValueError(f"{word} is not a JSON number")

    try:
        header = json.loads(raw, parse_constant=constant)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except RecursionError:
        raise CheckpointError(path, "unreadable header (nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(path, f"unreadable header ({exc})") from None
    return header


def _check_metadata(path: Path, info: Any) -> None:
    if info is None:
        # safetensors reads __metadata__ into an Option<HashMap<String, String>>, so null is
        # no metadata: safe_open loads such a file and its metadata() is None.
        return
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in info.items()
    ):
        raise CheckpointError(
            path, f"bad __metadata__ (safetensors allows strings to strings): {_short(info)}"
        )


def _uint(value: Any) -> bool:
    """An integer safetensors can hold (a ``usize``): not a bool, not a float."""
    return type(value) is int and 0 <= value < _LIMIT


def _entry(path: Path, name: str, info: Any, start: int) -> Entry:
    """One tensor's header entry, checked; ``start``: where the data begins in the file."""
    ok = (
        isinstance(info, dict)
        and info.get("dtype") in DTYPES
        and isinstance(info.get("shape"), list)
        and all(_uint(d) for d in info["shape"])
        and isinstance(info.get("data_offsets"), list)
        and len(info["data_offsets"]) == 2
        and all(_uint(x) for x in info["data_offsets"])
    )
    if not ok:
        raise CheckpointError(
            path,
            f"bad header entry for {name!r}: {_short(info)} (expected a known dtype, a shape "
            f"and two data_offsets, each a non-negative integer below 2**64)",
            name,
        )
    code, shape = info["dtype"], tuple(info["shape"])
    begin, end = info["data_offsets"]
    nbytes = DTYPES[code][1]
    for d in shape:
        nbytes *= d
    if nbytes >= _LIMIT or end < begin or end - begin != nbytes:
        raise CheckpointError(
            path,
            f"tensor {name!r}: byte range {begin}..{end} does not hold {list(shape)} {code}",
            name,
        )
    return Entry(path, start + begin, nbytes, code, shape)


def _check_ranges(path: Path, entries: dict[str, Entry], start: int, data: int) -> None:
    """Sorted by offset, the byte ranges start at 0, follow one another and end at the
    file's end: no tensor reads another's bytes, no byte belongs to none. ``start``: where
    the data begins in the file; ``data``: its bytes."""
    at, previous = 0, None
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].offset, kv[1].nbytes)):
        begin, end = e.offset - start, e.offset - start + e.nbytes
        if begin != at:
            after = f"after {previous!r}, which ends at byte {at}" if previous else "the first"
            what = "overlaps the tensor before it" if begin < at else "leaves a gap"
            raise CheckpointError(
                path,
                f"tensor {name!r}: byte range {begin}..{end} {what} ({after}); safetensors "
                "stores tensors contiguously from byte 0",
                name,
            )
        at, previous = end, name
    if at > data:
        raise CheckpointError(
            path,
            f"truncated: tensor {previous!r} ends at byte {start + at}, the file has "
            f"{start + data}",
            previous,
        )
    if at < data:
        raise CheckpointError(
            path,
            f"{data - at} bytes after the last tensor belong to none (safetensors: "
            "incomplete metadata)",
        )


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def given_paths(files: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The paths ``files`` names, as given (a file, an index or a folder each), checked
    for its form, not read."""
    if isinstance(files, Mapping):  # a state dict: its keys would be taken for paths
        raise TypeError(
            f"files must name safetensors files, got a {type(files).__name__} of "
            f"{len(files)} entries (a state dict?); load one that is in memory with "
            f"module.load_state_dict(state_dict), or save it once with "
            f"safetensors.torch.save_file(state_dict, 'model.safetensors') and pass that"
        )
    if isinstance(files, (str, os.PathLike)):
        items: list[Path] = [Path(files)]
    elif isinstance(files, Iterable) and not isinstance(files, bytes):
        items = [Path(f) for f in files]
    else:
        raise TypeError(
            f"files must be a .safetensors file, a sharded index, a folder or a list of "
            f"files; got {files!r}"
        )
    if not items:
        raise ValueError("no checkpoint files given; pass a .safetensors file or a list")
    return items


def checkpoint_files(
    files: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
) -> list[Path]:
    """The safetensors files behind ``files``: a file, a sharded index, a folder, or a list.

    A folder means its ``*.safetensors.index.json`` if it has one, else every
    ``*.safetensors`` in it. An index means the files its ``weight_map`` names.
    """
    out: list[Path] = []
    for item in given_paths(files):
        if item.is_dir():
            indexes = sorted(item.glob(f"*{INDEX_SUFFIX}"))
            if len(indexes) == 1:
                out.extend(_index_files(indexes[0]))
                continue
            found = sorted(item.glob("*.safetensors"))
            if not found:
                raise FileNotFoundError(f"no *.safetensors file in the folder {str(item)!r}")
            out.extend(found)
        elif item.name.endswith(INDEX_SUFFIX):
            out.extend(_index_files(item))
        elif not item.exists():
            raise FileNotFoundError(f"no checkpoint file at {str(item)!r}")
        else:
            out.append(item)
    return list(dict.fromkeys(out))


def pretrained_checkpoint(folder: Path, kwargs: Mapping[str, Any]) -> list[Path] | str:
    """The safetensors files a diffusers or transformers ``from_pretrained`` reads in
    ``folder`` (given its ``variant`` and ``use_safetensors`` keywords), or why there are
    none. Used by the diffusers adapter and by ``stageload.auto``, to reload from them."""
    if kwargs.get("use_safetensors") is False:
        return "use_safetensors=False"
    variant = kwargs.get("variant")
    for stem in ("diffusion_pytorch_model", "model"):
        if variant:
            names = [
                f"{stem}.{variant}.safetensors",
                f"{stem}.safetensors.index.{variant}.json",
                f"{stem}.{variant}.safetensors.index.json",
            ]
        else:
            names = [f"{stem}.safetensors", f"{stem}.safetensors.index.json"]
        for name in names:
            if (folder / name).is_file():
                # The shards an index names: diffusers' and transformers' variant index
                # (model.safetensors.index.fp16.json) does not end in .index.json, and was
                # taken for a safetensors file (no reload learned; keep_own opened the JSON).
                index = ".index." in name
                return _index_files(folder / name) if index else checkpoint_files(folder / name)
    return f"no safetensors checkpoint{f' for variant {variant!r}' if variant else ''} in {folder}"


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        items = weight_map.items()
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(index, f"not a sharded-checkpoint index ({exc!r})") from None
    names = {_shard_name(index, key, name) for key, name in items}
    return [index.parent / name for name in sorted(names)]


def _shard_name(index: Path, key: str, name: object) -> str:
    """``name``, a ``weight_map`` value, when it can name a shard file; else a
    ``CheckpointError`` naming the index and the key (a number or null here made a bare
    ``TypeError`` in the path join)."""
    if isinstance(name, str) and name:
        return name
    raise CheckpointError(
        index,
        f"weight_map[{key!r}] is {name!r}, not the name of a shard file",
        tensor=key,
        fix="each value must name a file beside the index, e.g. "
        "'model-00001-of-00002.safetensors'; save or download the index again",
    )


def read_entries(files: list[Path]) -> dict[str, Entry]:
    """Every tensor of every file; a name found in two files is an error naming both."""
    entries: dict[str, Entry] = {}
    for path in files:
        for name, entry in read_header(path).items():
            if name in entries:
                raise ValueError(
                    f"tensor {name!r} is in both {entries[name].file} and {path}; pass each "
                    f"shard once, or the index that lists them"
                )
            entries[name] = entry
    return entries


def checkpoint_bytes(
    files: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], dtype: Any = None
) -> int:
    """Bytes the tensors of ``files`` take once loaded, read from the headers alone.

    ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"bfloat16"``) is the dtype floating
    point tensors load as, as with ``load_weights(..., dtype=)``; integer and bool tensors
    keep theirs. ``None`` counts each tensor at its dtype in the file.
    """
    want = float_itemsize(dtype) if dtype is not None else None
    total = 0
    for entry in read_entries(checkpoint_files(files)).values():
        if want is not None and entry.is_floating:
            total += entry.nbytes // entry.itemsize * want
        else:
            total += entry.nbytes
    return total


def float_itemsize(dtype: Any) -> int:
    """Bytes per element of a floating point dtype: a ``torch.dtype`` or its name."""
    name = str(dtype).removeprefix("torch.")
    for torch_name, size, floating in DTYPES.values():
        if torch_name == name and floating:
            return size
    known = sorted(n for n, _, f in DTYPES.values() if f)
    raise ValueError(f"dtype must be a floating point dtype such as {known!r}, got {dtype!r}")


class Stamp(NamedTuple):
    """A file as it is on disk now: another inode after the file was replaced (a hub
    download, ``save_pretrained`` to the same folder), another size or time after it was
    written in place. ``sample``: a digest of its content (:func:`content_sample`), taken
    where a stamp is kept, so the same bytes again (``touch``, a copy or a re-download of
    the same file) are told from other weights."""

    ino: int
    size: int
    mtime_ns: int
    # The inode's change time, which no script can set back: a rewrite in place that
    # restores the modification time (os.utime) left the stamp as it was, and a reload
    # read the new weights silently.
    ctime_ns: int
    sample: bytes | None = None


def file_stamps(files: Iterable[Path], *, sampled: bool = False) -> dict[Path, Stamp | None]:
    """Each file's :class:`Stamp` now (None: missing), by absolute path (the process may
    change its directory before they are compared); ``sampled``: with its content sample."""
    stamps: dict[Path, Stamp | None] = {}
    for path in map(Path.absolute, map(Path, files)):
        try:
            st = os.stat(path)
        except OSError:
            stamps[path] = None
        else:
            sample = content_sample(path) if sampled else None
            stamps[path] = Stamp(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sample)
    return stamps


#: How :func:`changed_file` names a file it can no longer open.
UNREADABLE = "unreadable"


def _unreadable(path: Path) -> str | None:
    """How ``path`` cannot be opened for reading now (``unreadable (Permission denied)``),
    or None."""
    try:
        with open(path, "rb"):
            return None
    except OSError as exc:
        return f"{UNREADABLE} ({exc.strerror})"


def changed_file(stamps: dict[Path, Stamp | None]) -> tuple[Path, str] | None:
    """The first file that is not as ``stamps`` found it, and how; None if none.

    A file of the same size whose content sample is as it was (``touch``, the same bytes
    copied over it or renamed onto it, as rsync and a re-download do) is the same file: its
    stamp in ``stamps`` takes the new inode and time, so the next check is a ``stat`` again.
    """
    for path, now in file_stamps(stamps).items():
        then = stamps[path]
        if now == then or (then is not None and now == then._replace(sample=None)):
            continue
        if now is not None and then is not None and then.sample is None and now[:3] == then[:3]:
            continue  # no sample to tell a chmod from a rewrite by: its change time alone
        if now is None:
            return path, "deleted"
        if then is None:
            return path, "created"
        unreadable = _unreadable(path)  # a chmod changes the change time: not a rewrite
        if unreadable is not None:
            return path, unreadable
        same_size = now.size == then.size and then.sample is not None
        if same_size and content_sample(path) == then.sample:  # touched, or the same bytes
            stamps[path] = then._replace(ino=now.ino, mtime_ns=now.mtime_ns, ctime_ns=now.ctime_ns)
            continue
        if now.ino != then.ino:
            return path, "replaced"
        how = ["resized"] if now.size != then.size else []
        if now.mtime_ns != then.mtime_ns or not how:  # or its time set back
            how.append("rewritten")
        return path, " and ".join(how)
    return None


def check_unchanged(stamps: dict[Path, Stamp | None], since: str, fix: str) -> None:
    """Raise a :class:`CheckpointError` naming the first file that is not as ``stamps``
    found it: how it changed, then ``since`` (since when, and what a read now would do)."""
    changed = changed_file(stamps)
    if changed is None:  # as it was, but this process may not read it (another user, a mount)
        changed = next(
            ((p, how) for p in stamps if stamps[p] and (how := _unreadable(p)) is not None), None
        )
    if changed is not None:
        path, how = changed
        if how.startswith(UNREADABLE):
            raise CheckpointError(
                path,
                f"{how} since the model was first read from it, so it cannot be read again",
                fix="make it readable again (its permissions, chmod a+r, or its mount)",
            )
        raise CheckpointError(path, f"{how} {since}", fix=fix)


#: Bytes a content sample reads at each end of each tensor.
_SAMPLE_BYTES = 64


def content_sample(path: Path) -> bytes | None:
    """A digest of ``path``'s header and of the first and last bytes of each tensor in it:
    a file saved over with other weights differs in them (a fine-tune changes every value,
    an edit of one tensor its ends); the same bytes copied back, or a ``touch``, do not.
    A few KiB of reads per hundred tensors. None for a file that is not valid safetensors
    (any change to it then counts)."""
    try:
        entries = read_header(path)
        digest = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            digest.update(f.read(length))
            fd = f.fileno()
            for entry in sorted(entries.values(), key=lambda e: e.offset):
                last = entry.offset + entry.nbytes - _SAMPLE_BYTES
                for start in sorted({entry.offset, max(entry.offset, last)}):
                    digest.update(os.pread(fd, min(_SAMPLE_BYTES, entry.nbytes), start))
    except (OSError, CheckpointError):
        return None
    return digest.digest()
