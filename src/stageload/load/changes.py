"""Telling whether a loaded tensor was changed since its load: the one check.

A release frees what a reload can give back. A tensor the script changed cannot come back
from the files, so whoever releases (``stageload.auto``'s session, the diffusers
placeholder) must see the change first. torch counts in-place writes (:func:`version`),
but not those made through ``tensor.data`` (``w.data[5] += 1``, a textual inversion's
``weight.data[token] = v``), which have a counter of their own: those show only in the
values, so each load keeps a sample of them (:func:`sample`) to compare with later
(:func:`same`). A change to fewer than one element in :data:`SAMPLES` can go unseen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..external import tensor_version

if TYPE_CHECKING:
    import torch

#: Elements sampled per tensor, spread over the whole tensor.
SAMPLES = 1024


def version(t: torch.Tensor) -> int | None:
    """The in-place writes ``t`` has seen, or None for an inference tensor (it counts none:
    a change there shows only in its values)."""
    return None if t.is_inference() else tensor_version(t)


def sample(t: torch.Tensor) -> torch.Tensor | None:
    """Up to :data:`SAMPLES` values of ``t``, evenly spread, on the CPU (None for an empty
    tensor, or one on ``meta``). The stride is not a divisor of a row's length, so the
    samples drift across columns instead of reading one column of every row."""
    import torch

    if t.is_meta or t.numel() == 0:
        return None
    step = t.numel() // SAMPLES + 1
    with torch.no_grad():
        if t.is_contiguous():
            picked = t.detach().reshape(-1)[::step].clone()
        else:  # a transposed or sliced tensor: index it where its values are, copying no more
            at = torch.arange(0, t.numel(), step, device=t.device)
            picked = t.detach()[torch.unravel_index(at, t.shape)]
        return picked.cpu()


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two samples hold the same values (a NaN equal to a NaN: a checkpoint may hold
    NaNs, which a reload gives back as they were)."""
    import torch

    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() and not a.is_complex():
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def converted(s: torch.Tensor | None, dtype: Any) -> torch.Tensor | None:
    """Sample ``s`` as it reads once its tensor is converted to ``dtype`` (a conversion the
    script made, ``.half()``, is no change: a reload converts the same way)."""
    return s if s is None or s.dtype == dtype else s.to(dtype)
