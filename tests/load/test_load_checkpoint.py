"""A checkpoint is validated before its bytes are trusted, as safetensors validates it.

Each damaged header below is first shown to safetensors' own ``safe_open``, which rejects
it; ``load_weights`` must reject it too, with a ``CheckpointError`` naming the file and the
tensor, and leave the module released (never half filled, never with another tensor's
bytes). The controls: the same file undamaged loads in both; and with the range check
taken out, a shifted header loads silently with the wrong bytes, which is what main did.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from safetensors import SafetensorError, safe_open  # noqa: E402
from torch import nn  # noqa: E402

from stageload import CheckpointError, load_weights  # noqa: E402
from stageload.hooks.release import is_released  # noqa: E402
from stageload.load import checkpoint  # noqa: E402

DATA = struct.pack("<10f", *range(10))  # 40 bytes: ten float32 values 0..9


def f32(shape: list[Any], offsets: list[Any]) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


def write(path: Path, header: dict[str, Any] | bytes, data: bytes) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4))
        self.b = nn.Parameter(torch.zeros(4))


GOOD = {"a": f32([4], [0, 16]), "b": f32([4], [16, 32])}
DEEP = 100_000  # past Python's recursion limit and serde's (128)

#: name -> (header, data, the tensor the error names or None, what the message says)
DAMAGE: dict[str, tuple[dict[str, Any] | bytes, bytes, str | None, str]] = {
    "shifted": (
        {"a": f32([4], [8, 24]), "b": f32([4], [24, 40])},
        DATA,
        "a",
        "leaves a gap",
    ),
    "overlapping": (
        {"a": f32([4], [0, 16]), "b": f32([4], [8, 24]), "c": f32([4], [24, 40])},
        DATA,
        "b",
        "overlaps the tensor before it",
    ),
    "all at 0": ({"a": f32([4], [0, 16]), "b": f32([4], [0, 16])}, DATA[:16], "b", "overlaps"),
    "a gap between": (
        {"a": f32([4], [0, 16]), "b": f32([4], [24, 40])},
        DATA,
        "b",
        "leaves a gap",
    ),
    "bytes after the last": (GOOD, DATA, None, "8 bytes after the last tensor"),
    "past the end": (GOOD, DATA[:24], "b", "truncated: tensor 'b' ends at"),
    "range not dtype x shape": (
        {"a": f32([3], [0, 16]), "b": f32([4], [16, 32])},
        DATA[:32],
        "a",
        r"byte range 0..16 does not hold \[3\] F32",
    ),
    "elements overflow": (
        {"a": f32([2**40, 2**40], [0, 16])},
        DATA[:16],
        "a",
        "does not hold",
    ),
    "1e400 in a shape": (
        b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 16]}}',
        DATA[:16],
        "a",
        "bad header entry for 'a'",
    ),
    "1e400 in an offset": (
        b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1e400]}}',
        DATA[:16],
        "a",
        "bad header entry",
    ),
    "400 digits": (
        b'{"a": {"dtype": "F32", "shape": [' + b"9" * 400 + b'], "data_offsets": [0, 16]}}',
        DATA[:16],
        "a",
        "below 2\\*\\*64",
    ),
    "2**64": ({"a": f32([2**64], [0, 16])}, DATA[:16], "a", "bad header entry"),
    "a float dimension": ({"a": f32([4.0], [0, 16])}, DATA[:16], "a", "bad header entry"),
    "a negative dimension": ({"a": f32([-4], [0, 16])}, DATA[:16], "a", "bad header entry"),
    "a bool dimension": ({"a": f32([True], [0, 4])}, DATA[:4], "a", "bad header entry"),
    "NaN": (
        b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 16]}}',
        DATA[:16],
        None,
        "unreadable header .NaN is not a JSON number",
    ),
    "three offsets": ({"a": f32([4], [0, 16, 16])}, DATA[:16], "a", "bad header entry"),
    "unknown dtype": (
        {"a": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}},
        DATA[:16],
        "a",
        "known dtype",
    ),
    "deep nesting in metadata": (
        b'{"__metadata__": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        b"",
        None,
        "nested too deeply",
    ),
    "deep nesting in a shape": (
        b'{"a": {"dtype": "F32", "shape": ' + b"[" * DEEP + b"]" * DEEP + b', "data_offsets": []}}',
        b"",
        None,
        "nested too deeply",
    ),
    "metadata not strings": ({"__metadata__": {"x": 1}, **GOOD}, DATA[:32], None, "__metadata__"),
    "metadata a list": ({"__metadata__": [], **GOOD}, DATA[:32], None, "__metadata__"),
    "a null metadata value": (
        {"__metadata__": {"x": None}, **GOOD},
        DATA[:32],
        None,
        "__metadata__",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_header_is_rejected_as_safetensors_rejects_it(
    tmp_path: Path, damage: str
) -> None:
    header, data, tensor, says = DAMAGE[damage]
    path = write(tmp_path / "damaged.safetensors", header, data)
    with pytest.raises(SafetensorError), safe_open(str(path), "pt") as f:  # the reference
        for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
            f.get_tensor(key)
    module = Pair()
    with pytest.raises(CheckpointError, match=says) as caught:
        load_weights(module, path)
    assert caught.value.path == str(path) and str(path) in str(caught.value)
    assert caught.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(caught.value)
    assert is_released(module)


def test_a_header_longer_than_the_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SafetensorError):
        safe_open(str(path), "pt")
    with pytest.raises(CheckpointError, match="header length 1099511627776 exceeds"):
        load_weights(Pair(), path)


@pytest.mark.parametrize(
    "kind, says",
    [
        ("zip", "a PyTorch checkpoint .*convert it once"),
        ("legacy", "a pickle .*convert it once"),
        ("lfs", "a Git LFS pointer.*git lfs pull"),
    ],
)
def test_a_file_of_another_kind_is_named_not_called_damaged(
    tmp_path: Path, kind: str, says: str
) -> None:
    """A ``.pt`` passed for safetensors, or the LFS pointer a clone without ``git lfs``
    leaves, was "header length 578712552184433488 exceeds safetensors' limit ...; the file
    is damaged" (a new-user helper)."""
    path = tmp_path / "model.safetensors"
    if kind == "lfs":
        path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n")
    else:
        torch.save(Pair().state_dict(), path, _use_new_zipfile_serialization=kind == "zip")
    with pytest.raises(CheckpointError, match=f"not safetensors but {says}") as caught:
        load_weights(Pair(), path)
    assert "damaged" not in str(caught.value)


def test_a_header_length_that_starts_like_a_pickle_is_still_read(tmp_path: Path) -> None:
    """Control: a real safetensors file whose header length's first byte is a pickle's
    (0x80: a 128-byte header) loads; the kinds are named only for an impossible length."""
    header = json.dumps(GOOD).encode()
    header += b" " * (128 - len(header))
    path = write(tmp_path / "ok.safetensors", header, DATA[:32])
    assert path.read_bytes()[:1] == b"\x80"
    module = Pair()
    load_weights(module, path)
    assert module.b.tolist() == [4.0, 5.0, 6.0, 7.0]
    cut = tmp_path / "cut.safetensors"  # a 384-byte header (0x80 again), the file cut short
    header = json.dumps(GOOD).encode()
    write(cut, header + b" " * (384 - len(header)), DATA[:32])
    cut.write_bytes(cut.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="header length 384 exceeds the file's 200 bytes"):
        load_weights(Pair(), cut)


def test_control_the_undamaged_file_loads_in_both(tmp_path: Path) -> None:
    path = write(
        tmp_path / "good.safetensors", {"__metadata__": {"format": "pt"}, **GOOD}, DATA[:32]
    )
    with safe_open(str(path), "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    module = Pair()
    load_weights(module, path)
    assert torch.equal(module.a, want["a"]) and torch.equal(module.b, want["b"])
    assert module.b.tolist() == [4.0, 5.0, 6.0, 7.0]


def _old_check_metadata(path: Path, info: Any) -> None:
    """The metadata check before null was allowed."""
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in info.items()
    ):
        raise CheckpointError(path, f"bad __metadata__: {info!r}")


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_null_metadata_loads_as_safetensors_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed: bool
) -> None:
    """`"__metadata__": null` (no metadata to safetensors) was refused as a damaged header.
    Now it loads, equal to safetensors' own load. Control: the old check."""
    path = write(tmp_path / "null.safetensors", {"__metadata__": None, **GOOD}, DATA[:32])
    with safe_open(str(path), "pt") as f:
        assert f.metadata() is None
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if not fixed:
        monkeypatch.setattr(checkpoint, "_check_metadata", _old_check_metadata)
    module = Pair()
    try:
        load_weights(module, path)
    except CheckpointError as exc:
        loaded = False
        assert "__metadata__" in str(exc)
    else:
        loaded = torch.equal(module.a, want["a"]) and torch.equal(module.b, want["b"])
    assert loaded is fixed


def test_control_without_the_range_check_a_shifted_header_fills_wrong_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header, data, _, _ = DAMAGE["shifted"]
    path = write(tmp_path / "shifted.safetensors", header, data)
    monkeypatch.setattr(checkpoint, "_check_ranges", lambda *a: None)
    module = Pair()
    load_weights(module, path)  # no error: what main did
    assert module.a.tolist() == [2.0, 3.0, 4.0, 5.0]  # bytes 8..24, not the first tensor's
