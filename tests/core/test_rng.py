"""preserved_rng(): every global generator is back where it was after the block."""

from __future__ import annotations

import random

import numpy as np
import torch

from stageload import preserved_rng


def test_restores_torch_python_and_numpy_generators():
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    with preserved_rng():
        torch.randn(100)
        random.random()
        np.random.rand(10)
    after = (torch.randn(3), random.random(), np.random.rand(2))
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = (torch.randn(3), random.random(), np.random.rand(2))
    assert torch.equal(after[0], expected[0])
    assert after[1] == expected[1]
    assert np.array_equal(after[2], expected[2])


def test_restores_even_when_the_block_raises():
    torch.manual_seed(3)
    state = torch.get_rng_state()
    try:
        with preserved_rng():
            torch.randn(10)
            raise RuntimeError("loader failed")
    except RuntimeError:
        pass
    assert torch.equal(torch.get_rng_state(), state)


def test_same_rng_tells_each_generator_that_drew():
    """torch's, Python's and NumPy's draws each show; a GPU generator started between the
    two captures counts as drawn (a factory that built on the GPU may have drawn only
    there). The GPU state is a stand-in tensor: this machine has no GPU."""
    import dataclasses

    from stageload.core.rng import capture_rng, same_rng

    before = capture_rng()
    assert same_rng(before, capture_rng())
    for draw in (lambda: torch.randn(1), random.random, np.random.rand):
        state = capture_rng()
        draw()
        assert not same_rng(state, capture_rng())
    gpu = dataclasses.replace(before, cuda=[torch.zeros(8, dtype=torch.uint8)])
    assert not same_rng(before, gpu) and not same_rng(gpu, before)
    assert same_rng(gpu, dataclasses.replace(gpu))
    moved = dataclasses.replace(before, cuda=[torch.ones(8, dtype=torch.uint8)])
    assert not same_rng(gpu, moved)
