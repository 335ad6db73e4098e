"""Keep seeded runs reproducible while models are built lazily in the middle of them."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RngState:
    """Every global random generator's state at one moment (see :func:`capture_rng`)."""

    cpu: Any
    python: Any
    numpy: Any | None
    cuda: Any | None  # None: CUDA was not initialised when captured
    mps: Any | None


def capture_rng() -> RngState:
    """The state of torch's CPU, CUDA and MPS generators, ``random`` and NumPy's global one."""
    import torch

    np = sys.modules.get("numpy")
    return RngState(
        cpu=torch.get_rng_state(),
        python=random.getstate(),
        numpy=np.random.get_state() if np is not None else None,
        cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        mps=torch.mps.get_rng_state() if _mps_available(torch) else None,
    )


def restore_rng(state: RngState) -> None:
    """Put every global generator back to ``state``."""
    import torch

    torch.set_rng_state(state.cpu)
    random.setstate(state.python)
    np = sys.modules.get("numpy")
    if state.numpy is not None and np is not None:
        np.random.set_state(state.numpy)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(state.cuda)
    elif torch.cuda.is_initialized():
        # CUDA started since the capture: before its first use its generator was
        # "seeded, offset 0", which re-seeding with the same seed restores.
        torch.cuda.manual_seed_all(torch.cuda.initial_seed())
    if state.mps is not None:
        torch.mps.set_rng_state(state.mps)


def same_rng(a: RngState, b: RngState) -> bool:
    """Whether two captures hold the same states: no generator drew between them."""
    import torch

    if not torch.equal(a.cpu, b.cpu) or a.python != b.python:
        return False
    for x, y in ((a.cuda, b.cuda), (a.mps, b.mps)):  # None: not started then
        if (x is None) != (y is None):  # started between: it may have drawn
            return False
        if x is not None and not all(map(torch.equal, _listed(x), _listed(y))):
            return False
    if a.numpy is None or b.numpy is None:
        return True
    return all(
        bool((x == y).all()) if hasattr(x, "shape") else x == y
        for x, y in zip(a.numpy, b.numpy, strict=True)
    )


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore every global random generator to its state before the block.

    Building a model runs its random initialisation, which draws from the same global
    generators as the pipeline's noise. Without this, a model loaded in the middle of a
    seeded run shifts every later stage's noise. Covers torch's CPU, CUDA and MPS
    generators, Python's ``random`` and NumPy's global generator.
    """
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)


def _listed(state: Any) -> list[Any]:
    return state if isinstance(state, list) else [state]


def _mps_available(torch) -> bool:  # type: ignore[no-untyped-def]
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())
