"""Run the Pixal3D-mac port with staged loading, leaving its ``run()`` unchanged.

How the port is taken apart, in order:

1. Its pipeline is built by its own ``load_pipeline``, with ``pixal3d.models.from_pretrained``,
   ``build_image_cond_model`` and ``_load_naf`` replaced for the duration of the call: they
   record their arguments and return placeholders, so no weights are read.
2. ``StagedModels`` gets one loader per model, per feature extractor, for the shared DINOv3
   backbone and NAF upsampler, and for background removal. ``pipeline.models`` becomes the
   StagedModels mapping; the extractors and the remover become lazy stand-ins.
3. Stage boundaries are hooked with ``on_call`` on the port's own methods.

Models named in ``stream`` are loaded with :func:`stageload.streamed` instead: built from
``{path}.json`` with their weights on ``meta``, the parts outside their block list read when
their stage first needs them, each block read at its call and freed after it.

``load="auto"`` runs the port's own loading under :func:`stageload.auto`, the port's
factories wrapped (:meth:`Pixal3DRun.factories`): its models stand in until their first use
(:func:`~.port.stand_in`), and the port's stages (``run()``, :func:`~.plan.run_stages`)
seed auto's plan; models named in ``stream`` are built streamed, outside auto. Several
images run stage-major on auto's :class:`~stageload.autostage.StageMajor`, at the
adapter's boundaries. The boundaries and fingerprints are the same; the trace's stages are
the adapter's. ``load="eager"`` runs the port's own loading unstaged, for comparison.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..autostage import StageMajor
from ..core.events import NOTE, STAGE, Event, EventSink
from ..core.outer import emit_outer, outer_trace
from ..core.policy import PolicyView, ReleaseUnlisted
from ..core.staged import StagedModels
from ..core.streamed import Stream, StreamError, find_blocks, stream_of, streamed
from ..external import BUILD_LOCK
from ..hooks.on_call import on_call
from ..hooks.registry import patch
from ..hooks.share import share
from ..load.meta import build_on_meta
from ..load.placement import COPIED
from ._fill import FastReload
from ._parts import ExtractorRecipe, Holder, LazyEntry, NafRecipe, Unloaded, build_on_device
from .fingerprints import Fingerprints
from .plan import (
    BACKBONE,
    EXTRACTOR_STAGES,
    LOADS,
    MODEL_NAMES,
    NAF,
    REMBG,
    STAGES,
    check_stream,
    plan_for,
    run_stages,
)
from .port import Port, PortError, api_mismatch, config_build, stand_in

#: Held by the one open run (see Pixal3DRun's constructor).
_LIVE = threading.Lock()

#: Where the port defines the MoGe model its camera step loads (and drops) per image.
MOGE_MODULE, MOGE_CLASS = "pixal3d.utils.camera", "MoGeModel"

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

    def to_release(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> list[str]:
        names = super().to_release(stage, loaded, plan)
        return sorted(names, key=lambda name: name in (BACKBONE, NAF))  # stable sort

    def to_prefetch(self, stage: str, loaded: Sequence[str], plan: PolicyView) -> list[str]:
        return [n for n in self.parts.get(stage, ()) if n in plan.stages[stage] and n not in loaded]


@dataclass
class Image:
    """One image's run through the pipeline: the port's arguments for it, the stage it is
    in, the stages it reached, and its latents' fingerprints."""

    args: Any
    fingerprints: Fingerprints
    stage: str | None = None
    reached: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    """What a run did: where it stopped, the stages it entered, its latents' hashes."""

    load: str
    output: Path | None  # None when stopped before export
    stopped_after: str | None
    stages: list[str] = field(default_factory=list)
    fingerprints: list[dict[str, Any]] = field(default_factory=list)
    fingerprints_file: Path | None = None


class Pixal3DRun:
    """One run of the port: builds the pipeline (staged or eager), hooks its stage
    boundaries and samplers, runs it with :meth:`execute`, and cleans up on :meth:`close`.

    ``args`` is the port's own ``parse_args`` result. ``events`` receives loads, releases
    and stages (a MemoryMeter, a ListSink). ``stop_after`` ends the run at the boundary
    after that stage. ``fingerprints`` is a folder for the latents' hashes and copies.
    ``build_on="cpu"`` builds each model on the CPU and moves it, like the port (see
    :data:`BUILD_ON`). ``stream`` names models (of :data:`~.plan.MODEL_NAMES`) to stream
    block by block from their checkpoint instead of loading whole (:func:`stageload.streamed`):
    a streamed model is built when its stage first needs it and released like any model at
    the end of its stages, its parts outside the blocks with it (the next use builds it
    again: they are small, and its blocks are read at each call anyway).
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
        stream: Iterable[str] | None = None,
    ) -> None:
        if load not in LOADS:
            raise ValueError(f"load must be one of {', '.join(LOADS)}; got {load!r}")
        self.stream = check_stream(stream or ())
        if self.stream and load == "eager":
            raise ValueError(
                "stream needs load='staged' or 'auto': the port's own loading reads every "
                "model whole"
            )
        if load == "auto" and prefetch and budget is None:
            raise ValueError(
                "prefetch with load='auto' needs a budget (e.g. budget='auto'): with none, "
                "each stage releases what it does not use, and nothing can load ahead"
            )
        if stop_after is not None and stop_after not in STAGES:
            raise ValueError(f"stop_after must be one of {', '.join(STAGES)}; got {stop_after!r}")
        if build_on not in BUILD_ON:
            raise ValueError(f"build_on must be 'device' or 'cpu', got {build_on!r}")
        self.plan = plan_for(args.pipeline_type)  # refuses other pipelines before any work
        self.port = port
        self.load = load
        self.device: str = args.device
        self.events = events
        self.preserve_rng = preserve_rng
        self.stop_after = stop_after
        self.on_device = build_on == "device"
        self.residency = {"budget": budget, "prefetch": prefetch}  # StagedModels' own checks
        # The image being run: the run's own, or, under a batch, each call's (see image).
        self._own_image = Image(args, Fingerprints(fingerprints))
        self._image: contextvars.ContextVar[Image] = contextvars.ContextVar("pixal3d_image")
        self.models: StagedModels | None = None
        self.auto_stages: StageMajor | None = None  # load="auto": the stages it marks
        self._stack = ExitStack()
        self._extractor_stage: dict[int, str] = {}
        self._backbone_cache: dict[Any, Any] = {}
        # Staged: the remover the port built, until its first load; auto: its Holder.
        self._rembg: Any = None
        self._streams: dict[str, Stream] = {}  # each streamed model's latest stream
        # load="auto" with stream: each from_pretrained call's result and arguments, by id.
        self._calls: dict[int, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}
        self._fast = FastReload(self.device, self._note)
        # One live run per process: the port keeps its state in globals (its modules'
        # functions, which the builds replace, and the global random generator).
        if not _LIVE.acquire(blocking=False):
            raise RuntimeError(
                "another Pixal3D run is open in this process (one made without `with` is "
                "open until its close()): the port keeps its state in globals (its loading "
                "functions, the random generator), so two runs at once give wrong results; "
                "close it first, or run the images as one batch (run_many, or several "
                "images on the command line)"
            )
        self._live = True
        try:
            if load == "staged":
                self.pipeline = self._build_staged()
            elif load == "auto":
                self.pipeline = self._build_auto()
            else:
                self.pipeline = port.generate.load_pipeline(args, self.device)
            self._attach()
        except BaseException:
            self.close()
            raise

    @property
    def image(self) -> Image:
        """The image being run: in a batch, the image of the call running now (each call of
        ``StagedModels.map`` runs in its own context); otherwise the run's own."""
        return self._image.get(self._own_image)

    def run_image(self, image: Image) -> RunResult:
        """Run ``image`` instead of the run's own, in this context (one call of a batch)."""
        self._image.set(image)
        return self.execute()

    # -- building ------------------------------------------------------------------------
    def _build_staged(self) -> Any:
        port, gen = self.port, self.port.generate
        if port.backbone_class is None:
            raise api_mismatch(port.path, ["DINOv3ViTModel (the extractors' backbone class)"])
        from_pretrained = port.models.from_pretrained
        build_extractor = gen.build_image_cond_model
        # While the port builds its pipeline, its three loading functions record their
        # arguments and return placeholders, so no weights are read.
        with ExitStack() as recording:
            for owner, attr, record in (
                (port.models, "from_pretrained", lambda path, *a, **k: Unloaded(path, a, k)),
                (gen, "build_image_cond_model", lambda *a, **k: ExtractorRecipe(a, k)),
                (gen, "_load_naf", lambda *a, **k: NafRecipe(a, k)),
            ):
                recording.callback(patch(owner, attr, lambda _, record=record: record))
            pipeline = gen.load_pipeline(self.image.args, self.device)

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
        for name in self.stream:  # all of MODEL_NAMES are in found (checked above)
            build, file = self._stream_checked(name, found[name])
            loaders[name] = functools.partial(self._load_streamed, name, build, file)
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

    def factories(self) -> list[str]:
        """The port's model factories, as ``stageload.auto`` names them: its
        ``pixal3d.models.from_pretrained``, ``generate_mps._load_naf`` (the NAF upsampler),
        its DINOv3 backbone's ``from_pretrained`` (unless it is transformers', which auto
        wraps anyway) and MoGe's, where it has them. The background remover is built by a
        class call: it stays loaded."""
        port = self.port
        specs = [f"{port.models.__name__}:from_pretrained"]
        if callable(getattr(port.generate, "_load_naf", None)):  # NAF, once for three extractors
            specs.append(f"{port.generate.__name__}:_load_naf")
        backbone = port.backbone_class
        if backbone is not None and not backbone.__module__.startswith("transformers"):
            specs.append(f"{backbone.__module__}:{backbone.__qualname__}.from_pretrained")
        try:  # the port imports it at its camera step
            camera = importlib.import_module(MOGE_MODULE)
        except ImportError:
            camera = None
        if callable(getattr(getattr(camera, MOGE_CLASS, None), "from_pretrained", None)):
            specs.append(f"{MOGE_MODULE}:{MOGE_CLASS}.from_pretrained")
        return specs

    def _build_auto(self) -> Any:
        from ..autostage import auto

        budget, prefetch = self.residency["budget"], self.residency["prefetch"]
        session = self._stack.enter_context(
            auto(
                budget="auto" if budget is None else budget,
                factories=self.factories(),
                # The port's models stand in until their first use, so load_pipeline reads
                # none: the port reseeds before it samples, which the staged build, with
                # nothing built at setup, takes too.
                stand_ins={f"{self.port.models.__name__}:from_pretrained": stand_in},
                events=self.events,
                stages=False,  # the trace's stages are the adapter's (enter())
                prefetch=prefetch,
            )
        )
        # With no budget, hard stages as in the staged build: what the next stage does not
        # use is released, whatever the free memory (the export step needs it).
        listed = self._stages_objects if budget is None else None
        self.auto_stages = StageMajor(
            session, self.plan, emit=self._emit, listening=self._listening, listed=listed
        )
        if not self.stream:
            pipeline = self.port.generate.load_pipeline(self.image.args, self.device)
        else:
            # After auto's own wrap, for the build only: it sees what auto's returns.
            with ExitStack() as making:
                making.callback(patch(self.port.models, "from_pretrained", self._made))
                pipeline = self.port.generate.load_pipeline(self.image.args, self.device)
            self._stream_auto(pipeline)
            # Its low-VRAM moves would copy a streamed model's empty blocks (an error), and
            # on unified memory they free nothing: off, as in the staged build.
            pipeline.low_vram = False
        self._stage_remover(session, pipeline)
        return pipeline

    def _stage_remover(self, session: Any, pipeline: Any) -> None:
        """Hand the background remover to auto: the port builds it by a class call, which
        no factory makes, as a plain object holding its network. auto stages that network
        (:class:`~._parts.Holder`): its first load is the remover the port built; a reload
        builds the remover again (the port's class and ``pipeline.json`` spec) and takes
        its weights."""
        remover = getattr(pipeline, "rembg_model", None)
        if remover is None or isinstance(remover, nn.Module):
            return  # a module the port made through a factory is auto's already, or none
        rebuild, built = _rebuilder(remover, pipeline), [remover]

        def rembg() -> nn.Module:
            return Holder(built.pop() if built else rebuild())

        # Kept by the run: auto holds its models weakly, and the port holds the network only.
        self._rembg = session.call(rembg, REMBG, (), {})

    def _stages_objects(self) -> dict[str, list[Any]]:
        """The objects each stage uses (its models, extractors, backbone, NAF, remover)."""
        stages = run_stages(self.pipeline, self.image.args.pipeline_type)
        return dict(zip(self.plan, stages, strict=False))  # the same plan, in its order

    def _note(self, name: str, note: str) -> None:
        self._emit(Event(NOTE, model=name, stage=self.image.stage, note=note))

    def _note_fallback(self, name: str, why: str | None) -> None:
        if why is not None:
            self._emit(
                Event(
                    NOTE,
                    model=name,
                    stage=self.image.stage,
                    note=f"built on the CPU, then moved to {self.device}: building on the "
                    f"device failed ({why})",
                )
            )

    # -- loaders: one per model, extractor, shared part and the background remover ---------
    def _load_model(
        self, name: str, from_pretrained: Callable[..., Any], placeholder: Unloaded
    ) -> nn.Module:
        reloaded = self._fast.reload(name)  # refilled in place from its file (see _fill)
        if reloaded is not None:
            return reloaded

        def build() -> Any:
            with BUILD_LOCK:  # at a call, on the caller's thread
                return from_pretrained(
                    placeholder.path, *placeholder.call_args, **placeholder.call_kwargs
                )

        model, why = build_on_device(build, self.device, on_device=self.on_device)
        self._note_fallback(name, why)
        self._fast.learned(name, model.eval(), placeholder.path)
        return model

    def _stream_recipe(self, name: str, placeholder: Unloaded) -> tuple[Callable[[], Any], Path]:
        """How to build ``name`` without its weights, and its checkpoint file. The port's
        ``from_pretrained(path, **kwargs)`` builds ``getattr(pixal3d.models, config["name"])
        (**config["args"], **kwargs)`` from ``{path}.json``, then reads ``{path}.safetensors``
        whole; streaming needs the build alone."""
        path = os.fspath(placeholder.path)
        config_file, file = Path(f"{path}.json"), Path(f"{path}.safetensors")
        absent = [str(f) for f in (config_file, file) if not f.is_file()]
        if absent:
            raise StreamError(
                f"cannot stream {name!r}: no local file {', '.join(map(repr, absent))}; "
                "streaming reads the model's config and checkpoint from local files (pass "
                "the port a local --model-path)"
            )
        if placeholder.call_args:
            raise StreamError(
                f"cannot stream {name!r}: the port called from_pretrained with positional "
                f"arguments {placeholder.call_args!r} after the path, which stageload cannot "
                "map onto the model's constructor"
            )
        build = config_build(self.port.models, config_file, placeholder.call_kwargs)
        if isinstance(build, str):
            raise api_mismatch(
                self.port.path,
                [f"pixal3d.models.{build} (the class {str(config_file)!r} names)"],
            )
        return build, file

    def _stream_checked(self, name: str, placeholder: Unloaded) -> tuple[Callable[[], Any], Path]:
        """:meth:`_stream_recipe`, checked on meta before the run: a model without a block
        list fails now, not at its stage."""
        build, file = self._stream_recipe(name, placeholder)
        empty = build_on_meta(build)
        try:
            find_blocks(empty)
        except StreamError:  # with blocks=None, only "no list at all" is raised
            raise StreamError(
                f"cannot stream {name!r}: {type(empty).__name__} has no nn.ModuleList or "
                "nn.Sequential of blocks called one after another, so it can only be "
                "loaded whole; leave it out of stream (--stream)"
            ) from None
        return build, file

    def _made(self, wrapped: Callable[..., Any]) -> Callable[..., Any]:
        """The port's ``pixal3d.models.from_pretrained`` under ``load="auto"`` with
        ``stream``: auto's (``wrapped``), each call's arguments kept by what it returned,
        so :meth:`_stream_auto` finds the checkpoint of each ``pipeline.models`` entry (its
        file is named in ``pipeline.json``, not after its key)."""

        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            model = wrapped(*args, **kwargs)
            self._calls[id(model)] = (model, args, kwargs)
            return model

        return from_pretrained

    def _stream_auto(self, pipeline: Any) -> None:
        """Put a streamed model in ``pipeline.models`` for each name in ``stream``, built
        from the checkpoint its entry was made from. auto never sees it; the entry it
        replaces stands in on meta (never read: nothing uses it)."""
        models = getattr(pipeline, "models", None)
        for name in self.stream:
            entry = models.get(name) if isinstance(models, dict) else None
            call = self._calls.get(id(entry))
            if call is None or call[0] is not entry or not call[1]:
                raise api_mismatch(
                    self.port.path,
                    [f"pipeline.models[{name!r}] made by pixal3d.models.from_pretrained(path)"],
                )
            _, (path, *args), kwargs = call
            build, file = self._stream_checked(name, Unloaded(path, tuple(args), kwargs))
            models[name] = self._load_streamed(name, build, file)
        self._calls.clear()

    def _load_streamed(self, name: str, build: Callable[[], Any], file: Path) -> nn.Module:
        # Built anew at each load: the release at the end of its last stage emptied the
        # previous one (its blocks were empty already). Its prefetch thread goes with it.
        previous = self._streams.pop(name, None)
        if previous is not None:
            previous.close()
        # The port fills its models with load_state_dict: every tensor 64-byte aligned.
        model = streamed(
            build, file, device=self.device, name=name, events=self.events, placement=COPIED
        )
        stream = stream_of(model)
        if stream is not None:  # always, from streamed()
            self._streams[name] = stream
        return model.eval()

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
        if not seen and self.image.fingerprints.folder is not None:
            raise api_mismatch(
                self.port.path, ["pipeline samplers (attributes *_sampler with sample())"]
            )
        for remove in hooks:
            self._stack.callback(remove)

    def enter(self, stage: str) -> None:
        """Mark the start of ``stage``: staged runs release what it doesn't use."""
        image = self.image
        if stage == image.stage:
            return
        if self.stop_after is not None and STAGES.index(stage) > STAGES.index(self.stop_after):
            raise StopRun(self.stop_after)
        image.stage = stage
        image.reached.append(stage)
        if self.models is not None:
            if stage != "preprocess":
                # The remover the port built, never loaded (an image with its own alpha):
                # dropped once its stage is over, as the released one is; a later image
                # builds it again.
                self._rembg = None
            self.models.enter(stage)
        elif self.auto_stages is not None:
            self.auto_stages.mark(stage)
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
                stage=self.image.stage,
                note="get_proj_cond_shape received an extractor stageload does not know; "
                "the stage is unchanged",
            )
        )

    def _fingerprint(self, sampler: str, result: Any, *args: Any, **kwargs: Any) -> None:
        image = self.image
        image.fingerprints.add(
            getattr(result, "samples", result), sampler=sampler, stage=image.stage
        )

    def _emit(self, event: Event) -> None:
        # Events of the adapter itself (notes, an eager run's stages); StagedModels sends
        # its own to the outer trace.
        if self.events is not None:
            self.events.emit(event)
        emit_outer(event)

    def _listening(self) -> bool:
        """Whether :meth:`_emit` reaches a sink."""
        return self.events is not None or outer_trace() is not None

    # -- running -------------------------------------------------------------------------
    def execute(self) -> RunResult:
        """Run the port as its ``main`` does: preprocess, camera, ``run()``, export."""
        from PIL import Image as PILImage

        gen = self.port.generate
        image_state = self.image
        if image_state.reached:  # run before: this run's stages and latents start afresh
            image_state.stage, image_state.reached = None, []
            image_state.fingerprints = Fingerprints(image_state.fingerprints.folder)
        args = image_state.args
        output: Path | None = None
        stopped: str | None = None
        try:
            picture = PILImage.open(args.image)
            with tempfile.TemporaryDirectory(prefix="stageload-pixal3d-") as tmp:
                asset = gen.image_to_asset(self.pipeline, picture, args, self.device, tmp)
            self.enter("export")
            gen.asset_to_glb(asset, args.output, args)
            output = Path(args.output)
        except StopRun as stop:
            stopped = stop.stage
        finally:
            written = image_state.fingerprints.write(
                load=self.load,
                seed=getattr(args, "seed", None),
                pipeline_type=args.pipeline_type,
                stopped_after=stopped,
            )
        return RunResult(
            load=self.load,
            output=output,
            stopped_after=stopped,
            stages=list(image_state.reached),
            fingerprints=list(image_state.fingerprints.records),
            fingerprints_file=written,
        )

    def close(self) -> None:
        """Release every staged model and take the hooks and shares out again."""
        try:
            if self.models is not None:
                self.models.close()
            elif self.auto_stages is not None:
                self.auto_stages.close()
        finally:
            try:
                streams, self._streams = self._streams, {}
                for stream in streams.values():
                    stream.close()  # their models are released: this stops read-ahead threads
                self._stack.close()
            finally:
                live, self._live = getattr(self, "_live", False), False
                if live:  # once, however often close() is called
                    _LIVE.release()

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
