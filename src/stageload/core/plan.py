"""The stage plan: stages in pipeline order, each with the models it uses.

Calls of a pipeline cycle through the plan: after the last stage comes the first again.
Everything that reasons about "the next stage" or "the next use of a model" asks the
:class:`Plan` (the residency policies, ``StagedModels``' prefetch, adapters), so the cycle
is defined once. :func:`check_plan` is the one validation of a plan given by a user.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..load.loaders import is_model


class Plan(Mapping[str, tuple[str, ...]]):
    """Stage name -> the models it uses (a tuple), in pipeline order; a read-only mapping.

    A plan is a cycle: :meth:`next_stage` of the last stage is the first, and
    :meth:`next_use` counts stages around it.
    """

    __slots__ = ("_stages", "_order", "_at")

    def __init__(self, stages: Mapping[str, Iterable[str]]) -> None:
        self._stages: dict[str, tuple[str, ...]] = {s: tuple(n) for s, n in stages.items()}
        self._order = tuple(self._stages)
        self._at = {stage: i for i, stage in enumerate(self._order)}

    # -- the mapping -----------------------------------------------------------------------
    def __getitem__(self, stage: str) -> tuple[str, ...]:
        return self._stages[stage]

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, stage: object) -> bool:
        return stage in self._stages

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Plan):
            return self._stages == other._stages and self._order == other._order
        return isinstance(other, Mapping) and dict(self._stages) == dict(other)

    __hash__ = None  # type: ignore[assignment]  # a mapping compared by value

    def __repr__(self) -> str:
        return f"Plan({self._stages!r})"

    # -- the cycle -------------------------------------------------------------------------
    @property
    def order(self) -> tuple[str, ...]:
        """The stages in pipeline order."""
        return self._order

    def index(self, stage: str) -> int:
        """``stage``'s place in the pipeline order (KeyError naming the known ones)."""
        try:
            return self._at[stage]
        except KeyError:
            raise KeyError(
                f"unknown stage {stage!r}; known stages: {', '.join(self._order)}"
            ) from None

    def next_stage(self, stage: str) -> str:
        """The stage after ``stage``; after the last, the first (calls cycle)."""
        return self._order[(self.index(stage) + 1) % len(self._order)]

    def cycle(self, start: str, steps: int | None = None) -> Iterator[str]:
        """``start`` and the stages after it, around the cycle: ``steps`` of them
        (default: one lap, each stage once)."""
        at, n = self.index(start), len(self._order)
        for step in range(n if steps is None else steps):
            yield self._order[(at + step) % n]

    def next_use(self, name: str, stage: str) -> float:
        """Stages from ``stage`` until ``name`` is used again, around the cycle: 0 when
        ``stage`` lists it, ``inf`` when no stage does."""
        for step, s in enumerate(self.cycle(stage)):
            if name in self._stages[s]:
                return step
        return float("inf")

    def listed(self, name: str) -> bool:
        """Whether some stage uses ``name``."""
        return any(name in names for names in self._stages.values())

    def models(self) -> list[str]:
        """Every model some stage uses, once each, in order of first use."""
        return list(dict.fromkeys(n for names in self._stages.values() for n in names))


def check_plan(
    loaders: Mapping[str, Any], stages: Mapping[str, Iterable[str]], pinned: Iterable[str]
) -> Plan:
    """``StagedModels``' loaders, stages and pinned models checked; the plan as a Plan."""
    for name, loader in loaders.items():
        if not callable(loader):
            raise TypeError(
                f"loader for {name!r} must be a zero-argument callable that returns an "
                f"nn.Module, got {loader!r}"
            )
        if is_model(loader):  # an nn.Module (its class is a loader)
            raise TypeError(
                f"loader for {name!r} is a model ({type(loader).__name__}), not a function "
                f"that makes one: a released model cannot be loaded again from itself. Give "
                f"a function that builds and loads it, such as "
                f"from_safetensors({type(loader).__name__}, 'weights.safetensors')"
            )
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Mapping):
        raise TypeError(
            f"stages must map each stage name to the models it uses, e.g. "
            f"{{'encode': ['text_encoder']}}; got {stages!r}"
        )
    for stage, names in stages.items():
        if isinstance(names, str):
            raise TypeError(f"stage {stage!r} lists {names!r} as a string; use a list: [{names!r}]")
    plan = Plan(stages)
    known = ", ".join(sorted(loaders)) or "(none)"
    for stage, names in plan.items():
        for name in names:
            if name not in loaders:
                raise ValueError(
                    f"stage {stage!r} lists model {name!r}, which has no loader; "
                    f"models with loaders: {known}"
                )
    if isinstance(pinned, (str, bytes)):
        raise TypeError(f"pinned lists model names; got the string {pinned!r}: use [{pinned!r}]")
    for name in pinned:
        if name not in loaders:
            raise ValueError(f"pinned model {name!r} has no loader; models with loaders: {known}")
    return plan
