"""Stage marks: the first use of a component that is not staged still begins its stage.

The default plan stages only components worth it (``_plan.STAGE_FRACTION``); a 0.25 GB VAE
beside a 41 GB transformer loads with the pipeline and stays. Its stage is in the plan all
the same, with no models (``"decode": []``), and a :class:`StageMark` in the hook registry
of each of its submodules (as the placeholder's ``StageHook``, see ``_placeholder``) enters
that stage when the pipeline first computes with it. So traces, ``stageload report`` and
the plot show every stage the pipeline goes through, decoding's own time and peak
included; entering the stage releases what it does not list, as for any stage. Which
components are staged does not change.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..hooks.registry import HookRegistry, ModuleHook

if TYPE_CHECKING:
    from torch import nn

    from ..core.staged import StagedModels


class Stager(Protocol):
    """What a stage mark asks of its pipeline's stager (``StagedPipeline``)."""

    models: StagedModels
    plan: Mapping[str, tuple[str, ...]]

    def holds(self, name: str, component: nn.Module) -> bool: ...

    def begin(self, stage: str) -> None: ...


#: The registry name of the hook on every submodule of a marked component.
MARK = "stage_mark"


class StageMark(ModuleHook):
    """On every submodule of a component that stays loaded: its calls begin ``stage``.

    The stager is held weakly (the hook must not keep it alive), and a copy of the
    component (``copy.deepcopy``, ``torch.save``) has no mark: the pipeline does not hold
    the copy, so it would mark nothing, and the weak reference cannot be pickled.
    """

    copied = False

    def __init__(self, state: Stager, name: str, stage: str, component: nn.Module) -> None:
        self._state = weakref.ref(state)
        self.name = name
        self.stage = stage
        self.component = component

    def pre_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Runs before every submodule call of the component: inside its stage, one
        # comparison and nothing else.
        state = self._state()
        # Replaced on the pipeline (pipe.vae = ...), the old module marks nothing any more.
        if (
            state is not None
            and state.models.stage != self.stage
            and state.holds(self.name, self.component)
        ):
            state.begin(self.stage)
        return None

    def __repr__(self) -> str:
        return f"StageMark({self.name!r}, stage={self.stage!r})"


def attach(state: Stager, components: Mapping[str, Any], marks: Mapping[str, str]) -> None:
    """Put a :class:`StageMark` on every submodule of each marked component in
    ``components`` (the pipeline's); components that are not modules are skipped."""
    from torch import nn

    for name, stage in marks.items():
        component = components.get(name)
        if not isinstance(component, nn.Module) or stage not in state.plan:
            continue
        hook = StageMark(state, name, stage, component)
        for sub in component.modules():
            HookRegistry.attach(sub).add(MARK, hook)
