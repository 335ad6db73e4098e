"""``pipe.stageload.map(calls)``: N calls of a diffusers pipeline, stage-major.

diffusers keeps per-call state on the pipeline (``self._guidance_scale``,
``self._num_timesteps``, ...) and on its scheduler (timesteps, sigmas, the step index,
multistep history). Calls of a batch interleave at stage changes, and Wan 2.2 changes stage
inside its denoising loop, so each call runs on its own shallow copy of the pipeline
(components shared) with its own deep copy of every scheduler.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import StagedPipeline


def run_calls(
    state: StagedPipeline, calls: Iterable[Mapping[str, Any]], *, return_exceptions: bool
) -> list[Any]:
    """What :meth:`StagedPipeline.map` does."""
    pipe = state._pipeline() if state._pipeline is not None else None
    if pipe is None:
        raise RuntimeError("this StagedPipeline's pipeline is gone; map() needs it alive")
    if isinstance(calls, Mapping) or not isinstance(calls, Iterable):
        raise TypeError(
            f"calls must be a list of keyword-argument dicts for the pipeline, e.g. "
            f"[{{'prompt': 'a cat', 'generator': torch.Generator().manual_seed(0)}}], "
            f"got {calls!r}"
        )
    calls = list(calls)
    for i, kwargs in enumerate(calls):
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"calls[{i}] must be a dict of keyword arguments for "
                f"{type(pipe).__name__}.__call__, got {kwargs!r}"
            )

    def one(kwargs: Mapping[str, Any]) -> Any:
        state._in_batch.active = True  # this thread's calls are the batch's: no call lock
        try:
            return own_copy(pipe)(**kwargs)
        finally:
            state._in_batch.active = False

    with state.calls:  # the batch is one call of the pipeline for any other thread
        return state.models.map(one, calls, return_exceptions=return_exceptions)


def own_copy(pipe: Any) -> Any:
    """A shallow copy of ``pipe`` sharing its components, with its own scheduler copies."""
    from diffusers import SchedulerMixin

    mine = copy.copy(pipe)
    for name, component in pipe.components.items():
        if isinstance(component, SchedulerMixin):
            # Past DiffusionPipeline.__setattr__, which would rewrite the shared config.
            mine.__dict__[name] = copy.deepcopy(component)
    return mine
