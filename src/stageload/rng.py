"""Keep seeded runs reproducible while models are built lazily in the middle of them."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore every global random generator to its state before the block.

    Building a model runs its random initialisation, which draws from the same global
    generators as the pipeline's noise. Without this, a model loaded in the middle of a
    seeded run shifts every later stage's noise. Covers torch's CPU, CUDA and MPS
    generators, Python's ``random`` and NumPy's global generator.
    """
    import torch

    cpu_state = torch.get_rng_state()
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    cuda_was_init = torch.cuda.is_initialized()
    cuda_states = torch.cuda.get_rng_state_all() if cuda_was_init else None
    mps_state = torch.mps.get_rng_state() if _mps_available(torch) else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        random.setstate(py_state)
        if np_state is not None:
            np.random.set_state(np_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        elif torch.cuda.is_initialized():
            # CUDA started inside the block: before its first use its generator was
            # "seeded, offset 0", which re-seeding with the same seed restores.
            torch.cuda.manual_seed_all(torch.cuda.initial_seed())
        if mps_state is not None:
            torch.mps.set_rng_state(mps_state)


def _mps_available(torch) -> bool:  # type: ignore[no-untyped-def]
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())
