"""Release and RNG preservation on CUDA. Skipped on machines without a CUDA device (CI)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from stageload import StagedModels, preserved_rng, release

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_release_frees_allocated_and_reserved_cuda_memory():
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)]).cuda()  # 256 MiB
    held = model[0].weight
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    freed = release(model, name="m", stage="next")
    assert freed >= 256 * 2**20
    assert allocated - torch.cuda.memory_allocated() >= 0.99 * freed
    assert reserved - torch.cuda.memory_reserved() >= 0.9 * freed  # empty_cache ran
    assert held.untyped_storage().nbytes() == 0


def test_preserved_rng_restores_the_cuda_generator():
    torch.cuda.manual_seed(11)
    with preserved_rng():
        torch.randn(1000, device="cuda")
    after = torch.randn(4, device="cuda")
    torch.cuda.manual_seed(11)
    assert torch.equal(after, torch.randn(4, device="cuda"))


def test_cuda_first_initialised_inside_the_block_is_restored():
    """A loader that is the first to touch CUDA must not shift the run's CUDA noise."""
    code = textwrap.dedent(
        """
        import sys, torch
        from torch import nn
        from stageload import preserved_rng
        torch.manual_seed(5)
        if sys.argv[1] == "load":
            with preserved_rng():
                nn.Linear(256, 256, device="cuda")  # initialises CUDA, draws from its RNG
        print(torch.randn(3, device="cuda").tolist())
        """
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code, mode], capture_output=True, text=True, check=True
        ).stdout
        for mode in ("load", "plain")
    ]
    assert outs[0] == outs[1]


def test_staged_equals_eager_with_noise_on_cuda():
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(512, 512, generator=gen) for n in ("a", "b", "c")}

    def loader(name):
        def load():
            layer = nn.Linear(512, 512, bias=False, device="cuda")  # random init on CUDA
            with torch.no_grad():
                layer.weight.copy_(weights[name])
            return layer

        return load

    def run(get, enter):
        torch.manual_seed(3)
        x = torch.zeros(8, 512, device="cuda")
        for name in ("a", "b", "c"):
            enter(name)
            model = get(name)
            x = torch.tanh(model(x + torch.randn(8, 512, device="cuda")))
        return x

    eager_models = {n: loader(n)() for n in weights}
    eager = run(eager_models.__getitem__, lambda s: None)
    models = StagedModels({n: loader(n) for n in weights}, stages={n: [n] for n in weights})
    staged = run(models.__getitem__, models.enter)
    assert torch.equal(staged, eager)
    control = StagedModels(
        {n: loader(n) for n in weights}, stages={n: [n] for n in weights}, preserve_rng=False
    )
    assert not torch.equal(run(control.__getitem__, control.enter), eager)
