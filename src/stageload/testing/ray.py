"""A small staged pipeline for ``stageload.ray`` tests and examples: cheap to import
(torch and the core only), picklable by reference, with ``.stageload.map(calls)``.

Three real ``nn.Linear`` models (``te``, ``dit``, ``vae``) with fixed weights, one per
stage (``encode``, ``denoise``, ``decode``), like a text-to-image pipeline's shape. A call
takes a ``prompt`` (a number), a ``generator`` for its starting noise, and may ``hold`` in
its denoise stage until a test opens a gate, so the test can kill a worker mid-call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.staged import StagedModels

STAGES = {"encode": ["te"], "denoise": ["dit"], "decode": ["vae"]}
#: How long a held call waits for its gate before it fails: far past any test's kill.
HOLD_LIMIT_S = 900.0


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
        hold: str | None = None,
    ) -> torch.Tensor:
        if hold is not None:
            if not isinstance(hold, (str, os.PathLike)):
                raise TypeError(f"hold= takes a folder (a str or Path) to wait in, got {hold!r}")
            if not Path(hold).is_dir():
                raise FileNotFoundError(f"hold= names no folder: {hold!r}; create it first")
        m = self.models
        with torch.no_grad():
            m.enter("encode")
            h = m["te"](torch.full((1, self.width), float(prompt)))
            m.enter("denoise")
            z = torch.randn((1, self.width), generator=generator)
            for _ in range(steps):
                z = torch.tanh(m["dit"](z + h))
            if hold is not None:
                _hold(Path(hold))
            m.enter("decode")
            return m["vae"](z)


def _hold(gate: Path) -> None:
    """Wait until ``gate/open`` exists, first saying so with ``gate/busy-<pid>``: a test
    waits for that file, kills this process in the middle of its call, then opens the
    gate so the call's retry (and every other call) goes through."""
    opened = gate / "open"
    if opened.exists():
        return
    (gate / f"busy-{os.getpid()}").touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not opened.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no test opened {opened} within {HOLD_LIMIT_S:.0f} s")
        time.sleep(0.01)  # polling a file: the test has no other way to reach this process


def make_toy(width: int = 1024, budget: int | str | None = None) -> ToyPipeline:
    """The factory to give ``stageload.ray.run_batch`` (``partial(make_toy, width=...)``)."""
    return ToyPipeline(width, budget=budget)
