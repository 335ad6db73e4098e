"""A small staged pipeline for ``stageload.ray`` tests and examples: cheap to import
(torch and the core only), picklable by reference, with ``.stageload.map(calls)``.

Three real ``nn.Linear`` models (``te``, ``dit``, ``vae``) with fixed weights, one per
stage (``encode``, ``denoise``, ``decode``), like a text-to-image pipeline's shape. A call
takes a ``prompt`` (a number), a ``generator`` for its starting noise, and may ``sleep``
in its denoise stage so a test can catch the batch mid-run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from ..core.staged import StagedModels

STAGES = {"encode": ["te"], "denoise": ["dit"], "decode": ["vae"]}


def _linear(width: int, seed: int) -> nn.Module:
    # Loads run inside preserved_rng, so seeding here leaves the caller's stream alone.
    torch.manual_seed(seed)
    return nn.Linear(width, width)


class _Map:
    def __init__(self, pipe: ToyPipeline) -> None:
        self._pipe = pipe

    def map(self, calls: Iterable[Mapping[str, Any]]) -> list[Any]:
        pipe = self._pipe
        return pipe.models.map(lambda kwargs: pipe(**kwargs), list(calls))


class ToyPipeline:
    """``pipe(prompt=1.0, generator=g)`` -> a ``(1, width)`` tensor; staged, three models."""

    def __init__(self, width: int = 1024, *, budget: int | str | None = None) -> None:
        self.width = width
        loaders = {name: partial(_linear, width, k) for k, name in enumerate(["te", "dit", "vae"])}
        self.models = StagedModels(loaders, stages=STAGES, budget=budget)
        self.stageload = _Map(self)

    def __call__(
        self,
        prompt: float = 0.0,
        *,
        generator: torch.Generator | None = None,
        steps: int = 2,
        sleep: float = 0.0,
    ) -> torch.Tensor:
        m = self.models
        with torch.no_grad():
            m.enter("encode")
            h = m["te"](torch.full((1, self.width), float(prompt)))
            m.enter("denoise")
            z = torch.randn((1, self.width), generator=generator)
            for _ in range(steps):
                z = torch.tanh(m["dit"](z + h))
            if sleep:
                time.sleep(sleep)
            m.enter("decode")
            return m["vae"](z)


def make_toy(width: int = 1024, budget: int | str | None = None) -> ToyPipeline:
    """The factory to give ``stageload.ray.run_batch`` (``partial(make_toy, width=...)``)."""
    return ToyPipeline(width, budget=budget)
