"""The loaders a staged Pixal3D run gives StagedModels: one per model, per feature
extractor, for the shared backbone and NAF upsampler, and for background removal.

A mixin of :class:`~stageload.pixal3d.adapter.Pixal3DRun`, kept apart so that the run's
building and stage boundaries read on their own; the run sets the attributes declared here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from ._fill import FastReload
from ._parts import ExtractorRecipe, Holder, NafRecipe, Unloaded, build_on_device
from .port import Port


class Loaders:
    """The ``_load_*`` methods of :class:`~stageload.pixal3d.adapter.Pixal3DRun`."""

    # Set by Pixal3DRun.__init__ (and _note_fallback defined there).
    port: Port
    device: str
    on_device: bool
    _fast: FastReload
    _backbone_cache: dict[Any, Any]
    _rembg: Any
    _note_fallback: Callable[[str, str | None], None]

    def _load_model(
        self, name: str, from_pretrained: Callable[..., Any], placeholder: Unloaded
    ) -> nn.Module:
        reloaded = self._fast.reload(name)  # refilled in place from its file (see _fill)
        if reloaded is not None:
            return reloaded

        def build() -> Any:
            return from_pretrained(
                placeholder.path, *placeholder.call_args, **placeholder.call_kwargs
            )

        model, why = build_on_device(build, self.device, on_device=self.on_device)
        self._note_fallback(name, why)
        self._fast.learned(name, model.eval(), placeholder.path)
        return model

    def _load_extractor(
        self, name: str, recipe: ExtractorRecipe, build: Callable[..., Any]
    ) -> nn.Module:
        # The backbone and NAF come from share(): the live ones if their entries are
        # loaded (the policy loads them first), otherwise fresh ones.
        extractor, why = build_on_device(
            lambda: recipe.build(build, self._naf), self.device, on_device=self.on_device
        )
        self._note_fallback(name, why)
        return extractor if isinstance(extractor, nn.Module) else Holder(extractor)

    def _naf(self, recipe: NafRecipe) -> Any:
        return self.port.generate._load_naf(*recipe.args, **recipe.kwargs)  # shared

    def _load_backbone(
        self, recipes: Mapping[str, ExtractorRecipe], build: Callable[..., Any]
    ) -> nn.Module:
        """The backbone(s) the extractors share. Only an extractor's constructor knows how
        it calls ``from_pretrained``, so build each bare extractor (shared calls return the
        live backbone or build it once) and keep the backbones found inside."""
        found: dict[int, nn.Module] = {}
        for name, recipe in recipes.items():
            shell, why = build_on_device(
                lambda recipe=recipe: recipe.build_bare(build),
                self.device,
                on_device=self.on_device,
            )
            self._note_fallback(name, why)
            inside = {id(m) for m in Holder.wrap(shell).modules()}
            for value in list(self._backbone_cache.values()):
                if isinstance(value, nn.Module) and id(value) in inside:
                    found.setdefault(id(value), value)
            del shell  # its own small parts go; the backbone stays in share()'s cache
        if not found:
            raise RuntimeError(
                "building the feature extractors called no "
                f"{self.port.backbone_class.__qualname__}.from_pretrained: this port builds "
                "its backbone another way than the one stageload.pixal3d was written for"
            )
        backbones = list(found.values())
        return backbones[0] if len(backbones) == 1 else nn.ModuleList(backbones)

    def _load_nafs(self, recipes: Sequence[NafRecipe]) -> nn.Module:
        """The NAF upsampler(s) the extractors share, built from their recorded arguments."""
        nafs: dict[int, nn.Module] = {}
        for recipe in recipes:
            naf = self._naf(recipe)
            nafs.setdefault(id(naf), Holder.wrap(naf))
        if len(nafs) == 1:
            return next(iter(nafs.values()))
        return nn.ModuleList(nafs.values())

    def _load_rembg(self, rebuild: Callable[[], Any]) -> nn.Module:
        # The first load takes the remover the port built; later ones (a second image)
        # build it again, since the release left the first on meta.
        rembg, self._rembg = self._rembg, None
        if rembg is None:
            rembg = rebuild()
        return Holder.wrap(rembg).to(self.device)
