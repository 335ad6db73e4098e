"""Run the Pixal3D-mac port with staged loading, leaving its ``run()`` unchanged.

How the port is taken apart, in order:

1. Its pipeline is built by its own ``load_pipeline``, with ``pixal3d.models.from_pretrained``,
   ``build_image_cond_model`` and ``_load_naf`` replaced for the duration of the call: they
   record their arguments and return placeholders, so no weights are read.
2. ``StagedModels`` gets one loader per model, per feature extractor, for the shared DINOv3
   backbone and NAF upsampler, and for background removal. ``pipeline.models`` becomes the
   StagedModels mapping; the extractors and the remover become lazy stand-ins.
3. Stage boundaries are hooked with ``on_call`` on the port's own methods.

``load="eager"`` runs the port's own loading instead, with the same boundaries and
fingerprints, for comparison.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..events import NOTE, STAGE, Event, EventSink
from ..hooks import on_call
from ..outer import emit_outer
from ..share import share
from ..staged import Plan, ReleaseUnlisted, StagedModels
from ._fill import FastReload
from ._loaders import Loaders
from ._parts import ExtractorRecipe, LazyEntry, NafRecipe, Unloaded
from .fingerprints import Fingerprints
from .plan import BACKBONE, EXTRACTOR_STAGES, MODEL_NAMES, NAF, REMBG, STAGES, plan_for
from .port import Port, PortError, api_mismatch

#: The ways to load: stageload's staged loading, or the port's own.
LOADS = ("staged", "eager")

#: Where staged loaders build each model: on the target device (fast, the default), or on
#: the CPU and then moved, as the port does. Buffers a constructor computes (rotary
#: tables) can differ in the last bits between devices: on CUDA that alone made the
#: stub's staged latents differ from eager ones; built on the CPU they were identical.
BUILD_ON = ("device", "cpu")


class StopRun(BaseException):  # noqa: N818 - a signal, not an error
    """Raised at the boundary after the ``stop_after`` stage to end the run there.

    A BaseException, like KeyboardInterrupt, so an ``except Exception`` in the port lets
    it through.
    """

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


class SharedPartsLast(ReleaseUnlisted):
    """Release the extractors before the backbone and NAF they share, so each release
    event counts the bytes it frees itself; on entering an extractor's stage, load the
    shared parts it uses first, so they are entries of their own that outlive it.

    ``parts`` maps each stage to the shared parts its extractor uses.
    """

    def __init__(self, parts: Mapping[str, Sequence[str]] | None = None) -> None:
        self.parts = {stage: tuple(names) for stage, names in (parts or {}).items()}

    def to_release(self, stage: str, loaded: Sequence[str], plan: Plan) -> list[str]:
        names = super().to_release(stage, loaded, plan)
        return sorted(names, key=lambda name: name in (BACKBONE, NAF))  # stable sort

    def to_prefetch(self, stage: str, loaded: Sequence[str], plan: Plan) -> list[str]:
        return [n for n in self.parts.get(stage, ()) if n in plan.stages[stage] and n not in loaded]


@dataclass
class RunResult:
    """What a run did: where it stopped, the stages it entered, its latents' hashes."""

    load: str
    output: Path | None  # None when stopped before export
    stopped_after: str | None
    stages: list[str] = field(default_factory=list)
    fingerprints: list[dict[str, Any]] = field(default_factory=list)
    fingerprints_file: Path | None = None


class Pixal3DRun(Loaders):
    """One run of the port: builds the pipeline (staged or eager), hooks its stage
    boundaries and samplers, runs it with :meth:`execute`, and cleans up on :meth:`close`.

    ``args`` is the port's own ``parse_args`` result. ``events`` receives loads, releases
    and stages (a MemoryMeter, a ListSink). ``stop_after`` ends the run at the boundary
    after that stage. ``fingerprints`` is a folder for the latents' hashes and copies.
    ``build_on="cpu"`` builds each model on the CPU and moves it, like the port (see
    :data:`BUILD_ON`).
    """

    def __init__(
        self,
        port: Port,
        args: Any,
        *,
        load: str = "staged",
        events: EventSink | None = None,
        preserve_rng: bool = True,
        stop_after: str | None = None,
        fingerprints: str | Path | None = None,
        build_on: str = "device",
        budget: int | str | None = None,
        prefetch: bool = False,
    ) -> None:
        if load not in LOADS:
            raise ValueError(f"load must be 'staged' or 'eager', got {load!r}")
        if stop_after is not None and stop_after not in STAGES:
            raise ValueError(f"stop_after must be one of {', '.join(STAGES)}; got {stop_after!r}")
        if build_on not in BUILD_ON:
            raise ValueError(f"build_on must be 'device' or 'cpu', got {build_on!r}")
        self.plan = plan_for(args.pipeline_type)  # refuses other pipelines before any work
        self.port = port
        self.args = args
        self.load = load
        self.device: str = args.device
        self.events = events
        self.preserve_rng = preserve_rng
        self.stop_after = stop_after
        self.on_device = build_on == "device"
        self.residency = {"budget": budget, "prefetch": prefetch}  # StagedModels' own checks
        self.fingerprints = Fingerprints(fingerprints)
        self.stage: str | None = None
        self.reached: list[str] = []
        self.models: StagedModels | None = None
        self._stack = ExitStack()
        self._extractor_stage: dict[int, str] = {}
        self._backbone_cache: dict[Any, Any] = {}
        self._rembg: Any = None  # the remover the port built, until its first load
        self._fast = FastReload(self.device, self._note)
        try:
            if load == "staged":
                self.pipeline = self._build_staged()
            else:
                self.pipeline = port.generate.load_pipeline(args, self.device)
            self._attach()
        except BaseException:
            self.close()
            raise

    # -- building ------------------------------------------------------------------------
    def _build_staged(self) -> Any:
        port, gen = self.port, self.port.generate
        if port.backbone_class is None:
            raise api_mismatch(port.path, ["DINOv3ViTModel (the extractors' backbone class)"])
        from_pretrained = port.models.from_pretrained
        build_extractor = gen.build_image_cond_model
        load_naf = gen._load_naf
        port.models.from_pretrained = lambda path, *a, **k: Unloaded(path, a, k)
        gen.build_image_cond_model = lambda *a, **k: ExtractorRecipe(a, k)
        gen._load_naf = lambda *a, **k: NafRecipe(a, k)
        try:
            pipeline = gen.load_pipeline(self.args, self.device)
        finally:
            port.models.from_pretrained = from_pretrained
            gen.build_image_cond_model = build_extractor
            gen._load_naf = load_naf

        found = getattr(pipeline, "models", None)
        if not isinstance(found, dict):
            raise api_mismatch(port.path, ["pipeline.models (a dict of models)"])
        missing = [f"pipeline.models[{n!r}]" for n in MODEL_NAMES if n not in found]
        recipes = {a: getattr(pipeline, a, None) for a in EXTRACTOR_STAGES}
        missing += [
            f"pipeline.{a} (set by init_pipeline through build_image_cond_model)"
            for a, r in recipes.items()
            if not isinstance(r, ExtractorRecipe)
        ]
        if missing:
            raise api_mismatch(port.path, missing)
        eager = sorted(n for n, m in found.items() if not isinstance(m, Unloaded))
        if eager:
            raise PortError(
                f"the port built {', '.join(eager)} without calling "
                "pixal3d.models.from_pretrained, so stageload cannot defer their loading; "
                "this port differs from the one stageload.pixal3d was written for"
            )

        # Each loader builds its model on its own, so a residency policy may load them in
        # any order and a run may process several images. Identical from_pretrained and
        # _load_naf calls return one live instance (share() rebuilds a released one).
        self._backbone_cache = self._stack.enter_context(
            share(port.backbone_class, "from_pretrained")
        )
        self._stack.enter_context(share(gen, "_load_naf"))
        loaders: dict[str, Callable[[], nn.Module]] = {}
        for name, placeholder in found.items():
            loaders[name] = functools.partial(self._load_model, name, from_pretrained, placeholder)
        for attr, recipe in recipes.items():
            loaders[attr] = functools.partial(self._load_extractor, attr, recipe, build_extractor)
        loaders[BACKBONE] = functools.partial(self._load_backbone, recipes, build_extractor)
        nafs = [naf for recipe in recipes.values() for naf in recipe.nafs()]
        loaders[NAF] = functools.partial(self._load_nafs, nafs)
        self._rembg = getattr(pipeline, "rembg_model", None)
        if self._rembg is not None:
            loaders[REMBG] = functools.partial(self._load_rembg, _rebuilder(self._rembg, pipeline))
        # The shared parts each extractor stage loads first (the ss extractor has no NAF).
        parts = {
            EXTRACTOR_STAGES[attr]: (BACKBONE, NAF) if recipe.nafs() else (BACKBONE,)
            for attr, recipe in recipes.items()
        }

        stages = {s: tuple(n for n in names if n in loaders) for s, names in self.plan.items()}
        self.models = StagedModels(
            loaders,
            stages=stages,
            events=self.events,
            preserve_rng=self.preserve_rng,
            # Under a budget the policy is FurthestNextUse (docs/residency.md).
            policy=None if self.residency["budget"] is not None else SharedPartsLast(parts),
            **self.residency,
        )
        pipeline.models = self.models
        for attr in recipes:
            setattr(pipeline, attr, LazyEntry(self.models, attr))
        if self._rembg is not None:
            pipeline.rembg_model = LazyEntry(self.models, REMBG)
        # Low-VRAM mode parks idle models "on the CPU": on unified memory that is the same
        # RAM, so it frees nothing and adds a second copy of the active model.
        pipeline.low_vram = False
        return pipeline

    def _note(self, name: str, note: str) -> None:
        self._emit(Event(NOTE, model=name, stage=self.stage, note=note))

    def _note_fallback(self, name: str, why: str | None) -> None:
        if why is not None:
            self._emit(
                Event(
                    NOTE,
                    model=name,
                    stage=self.stage,
                    note=f"built on the CPU, then moved to {self.device}: building on the "
                    f"device failed ({why})",
                )
            )

    # -- boundaries ----------------------------------------------------------------------
    def _attach(self) -> None:
        p = self.pipeline
        for attr, stage in EXTRACTOR_STAGES.items():
            value = getattr(p, attr, None)
            if value is not None:
                self._extractor_stage[id(value)] = stage

        def enter(stage: str) -> Callable[..., None]:
            return lambda *args, **kwargs: self.enter(stage)

        hooks = [
            on_call(p, "preprocess_image", before=enter("preprocess"), after=enter("camera")),
            on_call(p, "get_proj_cond_ss", before=enter("structure")),
            on_call(p, "get_proj_cond_shape", before=self._enter_extractor_stage),
            on_call(p, "decode_latent", before=enter("decode")),
        ]
        seen: set[int] = set()
        for attr, sampler in sorted(vars(p).items()):
            is_sampler = attr.endswith("sampler") and callable(getattr(sampler, "sample", None))
            if is_sampler and id(sampler) not in seen:
                seen.add(id(sampler))
                after = functools.partial(self._fingerprint, attr)
                hooks.append(on_call(sampler, "sample", after=after))
        if not seen and self.fingerprints.folder is not None:
            raise api_mismatch(
                self.port.path, ["pipeline samplers (attributes *_sampler with sample())"]
            )
        for remove in hooks:
            self._stack.callback(remove)

    def enter(self, stage: str) -> None:
        """Mark the start of ``stage``: staged runs release what it doesn't use."""
        if stage == self.stage:
            return
        if self.stop_after is not None and STAGES.index(stage) > STAGES.index(self.stop_after):
            raise StopRun(self.stop_after)
        self.stage = stage
        self.reached.append(stage)
        if self.models is not None:
            self.models.enter(stage)
        else:
            self._emit(Event(STAGE, stage=stage))

    def _enter_extractor_stage(self, *args: Any, **kwargs: Any) -> None:
        for value in (*args[:1], *kwargs.values()):
            stage = self._extractor_stage.get(id(value))
            if stage is not None:
                self.enter(stage)
                return
        self._emit(
            Event(
                NOTE,
                stage=self.stage,
                note="get_proj_cond_shape received an extractor stageload does not know; "
                "the stage is unchanged",
            )
        )

    def _fingerprint(self, sampler: str, result: Any, *args: Any, **kwargs: Any) -> None:
        self.fingerprints.add(getattr(result, "samples", result), sampler=sampler, stage=self.stage)

    def _emit(self, event: Event) -> None:
        # Events of the adapter itself (notes, an eager run's stages); StagedModels sends
        # its own to the outer trace.
        if self.events is not None:
            self.events.emit(event)
        emit_outer(event)

    # -- running -------------------------------------------------------------------------
    def execute(self) -> RunResult:
        """Run the port as its ``main`` does: preprocess, camera, ``run()``, export."""
        from PIL import Image

        gen = self.port.generate
        output: Path | None = None
        stopped: str | None = None
        try:
            image = Image.open(self.args.image)
            with tempfile.TemporaryDirectory(prefix="stageload-pixal3d-") as tmp:
                asset = gen.image_to_asset(self.pipeline, image, self.args, self.device, tmp)
            self.enter("export")
            gen.asset_to_glb(asset, self.args.output, self.args)
            output = Path(self.args.output)
        except StopRun as stop:
            stopped = stop.stage
        finally:
            written = self.fingerprints.write(
                load=self.load,
                seed=getattr(self.args, "seed", None),
                pipeline_type=self.args.pipeline_type,
                stopped_after=stopped,
            )
        return RunResult(
            load=self.load,
            output=output,
            stopped_after=stopped,
            stages=list(self.reached),
            fingerprints=list(self.fingerprints.records),
            fingerprints_file=written,
        )

    def close(self) -> None:
        """Release every staged model and take the hooks and shares out again."""
        try:
            if self.models is not None:
                self.models.close()
        finally:
            self._stack.close()

    def __enter__(self) -> Pixal3DRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(port: Port, args: Any, **options: Any) -> RunResult:
    """Build, execute and close one :class:`Pixal3DRun`; ``options`` as its constructor."""
    with Pixal3DRun(port, args, **options) as pixal3d_run:
        return pixal3d_run.execute()


def _rebuilder(rembg: Any, pipeline: Any) -> Callable[[], Any]:
    """How to build the background remover again once released. The port builds it in
    ``from_pretrained`` as ``getattr(rembg, spec["name"])(**spec["args"])`` with the spec
    from ``pipeline.json``, kept in ``pipeline._pretrained_args["rembg_model"]``."""
    spec = getattr(pipeline, "_pretrained_args", {}).get("rembg_model")
    cls = type(rembg)

    def rebuild() -> Any:
        if not isinstance(spec, dict):
            raise RuntimeError(
                "the background remover was released after an earlier image, and "
                "pipeline._pretrained_args has no 'rembg_model' spec to build it again; "
                "this port differs from the one stageload.pixal3d was written for"
            )
        return cls(**spec.get("args", {}))

    return rebuild
