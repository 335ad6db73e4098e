"""Where a loaded tensor sits in memory: one rule for every path that fills a module.

Bit-identical output needs identical inputs to every kernel, and a tensor's address is one
of them: BLAS kernels (MKL's, oneDNN's) may take a different code path, and round
differently, for an input that starts at a different offset within a cache line. On a
2-core AMD EPYC with AVX-512 an SD UNet whose streamed blocks sat 64-byte aligned differed
from ``from_pretrained``'s by 2e-7, where ``from_pretrained`` had left each weight at its
offset in the file's mmap. So every path that fills a module from a checkpoint (first loads,
refills, streamed blocks, the adapters' loads) puts each CPU tensor at the address
alignment (mod :data:`ALIGN`) that the *reference loader of that path* gives it. A
:class:`Placement` says what that reference does:

- :data:`MAPPED`: safetensors' own readers (``load_file``, ``safe_open``) and diffusers'
  ``from_pretrained``, which keeps their tensors (measured: every tensor of a Flux
  transformer at its file offset mod 64): a tensor whose bytes are the file's (CPU, dtype
  unchanged) sits in the file's page-aligned mmap, so at its file offset mod 64; a
  converted one is a fresh allocation, 64-byte aligned (torch's CPU allocator). The
  diffusers adapter streams with it. Costs up to 64 bytes more per tensor.
- :data:`COPIED` (the default of ``load_weights``, ``from_safetensors``, ``streamed``):
  ``module.load_state_dict(load_file(...))`` into a module built on the CPU (the Pixal3D
  port does this): every tensor is the module's own allocation, 64-byte aligned.
- :meth:`Placement.recorded`: measured on a reference load (``load.refill.learn``, for the
  adapters' refills); a tensor recorded there sits where the reference put it.

The residue is taken mod 64 (a cache line, and the widest vector load, AVX-512's): what
the kernels can see. Accelerator tensors are left to their allocator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint import DTYPES, Entry

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "COPIED", "MAPPED", "Placement", "empty_at", "misalignment"]

#: Addresses are reproduced modulo this many bytes.
ALIGN = 64


@dataclass(frozen=True)
class Placement:
    """Where a reference loader puts each tensor it loads (address mod :data:`ALIGN`)."""

    #: True: unconverted CPU tensors at their file offset (an mmap); False: all aligned.
    mapped: bool
    #: Measured on a reference load, by (file, offset in it) of the tensor's bytes: wins.
    measured: Mapping[tuple[Path, int], int] = field(default_factory=dict)

    def misalign(self, entry: Entry, dtype: torch.dtype, device: torch.device) -> int:
        """The address mod :data:`ALIGN` of the tensor loaded from ``entry`` as ``dtype``
        on ``device`` (0 off the CPU: the device's allocator decides)."""
        if device.type != "cpu":
            return 0
        at = self.measured.get((entry.file, entry.offset))
        if at is not None:
            return at
        if self.mapped and _dtype_code(dtype) == entry.dtype:
            return entry.offset % ALIGN
        return 0

    @staticmethod
    def recorded(tensors: Mapping[Entry, torch.Tensor], *, mapped: bool = True) -> Placement:
        """The placement a reference load gave: each loaded tensor by the entry it came
        from. ``mapped`` is the rule for tensors it did not load."""
        return Placement(
            mapped,
            {
                (e.file, e.offset): misalignment(t)
                for e, t in tensors.items()
                if t.device.type == "cpu"
            },
        )


#: safetensors' readers and the ``from_pretrained`` that keeps their tensors.
MAPPED = Placement(mapped=True)
#: ``load_state_dict`` copying into a module built on the CPU.
COPIED = Placement(mapped=False)


def misalignment(tensor: torch.Tensor) -> int:
    """Where ``tensor`` starts, mod :data:`ALIGN`: what the rule reproduces."""
    return tensor.data_ptr() % ALIGN


def empty_at(shape: tuple[int, ...], dtype: torch.dtype, misalign: int) -> torch.Tensor:
    """A fresh CPU tensor whose address is ``misalign`` mod :data:`ALIGN`.

    0 (or a residue the dtype cannot start at) is a plain ``torch.empty``, which torch's
    allocator aligns to 64; otherwise a view into 64 spare bytes more.
    """
    import torch

    itemsize = dtype.itemsize
    if misalign % itemsize or not 0 < misalign < ALIGN:
        return torch.empty(shape, dtype=dtype)
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    shift = (misalign - raw.data_ptr()) % ALIGN
    return raw[shift : shift + nbytes].view(dtype).view(shape)


#: torch dtype name -> safetensors code.
_CODES = {name: code for code, (name, _, _) in DTYPES.items()}


def _dtype_code(dtype: torch.dtype) -> str | None:
    return _CODES.get(str(dtype).removeprefix("torch."))
