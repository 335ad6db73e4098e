"""Staged loading for any diffusers pipeline: each large model is in memory only for its stages.

    from stageload.diffusers import staged_pipeline

    pipe = staged_pipeline(QwenImage21Pipeline, "Qwen/Qwen-Image-2.1", torch_dtype=torch.bfloat16)
    image = pipe(prompt, num_inference_steps=20).images[0]

The pipeline's own ``__call__`` runs unchanged. Its text encoder, denoiser and VAE are
placeholders (see ``_placeholder``) that load on their first use and are released when the
pipeline moves to a stage that does not list them. Installed as ``stageload[diffusers]``;
the core of stageload never imports this package.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..bell import Bell
from ..core.batch import entered, thread_modes
from ..core.events import NOTE, Event, EventSink
from ..core.staged import StagedModels
from ..errors import StageloadError
from ..external import BUILD_LOCK, progress_bars_disabled
from ..hooks.empty import mark_empty
from ..hooks.registry import patch
from ..hooks.release import ReleasedModuleError, release, releasing
from ..load.checkpoint import Stamp, check_unchanged, file_stamps, pretrained_checkpoint
from ..load.loaders import BACKGROUND_READY_ATTR, rng_free
from ..load.refill import Recipe, converted, learn, reload
from ..load.skeleton import build_empty, can_stage, is_transformers_model, skeleton_dtype
from ..memory.budget import parse_budget
from . import _marks, _placeholder
from ._args import (
    _MODEL_KWARGS,
    _check_device,
    _check_pipeline_cls,
    _check_variant,
    _concrete_pipeline,
    _dtype_kwarg,
    _is_auto_pipeline,
    _load_component,
    _resolve_folder,
    check_keep,
)
from ._placeholder import StagedChangeError, StageHook, StagingRemovedError
from ._plan import (
    check_fits,
    choose_plan,
    component_sizes,
    default_plan,
    mark_begins,
    model_components,
    refine,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "StagedChangeError",
    "StagedPipeline",
    "StagingRemovedError",
    "default_plan",
    "staged_pipeline",
]


class StagedPipeline:
    """The staging state of one pipeline, at ``pipe.stageload``.

    ``models`` is the :class:`~stageload.StagedModels` registry (``models[name]`` loads a
    component and returns the pipeline's own object for it); ``plan`` the stages;
    ``close()`` releases everything for good.

    With the default plan (``adaptive``), the plan is refined by what the pipeline does:
    a component of unknown role joins the stage in which it is first used, one first used
    after its planned stage moves there, and one used before the denoiser that its planned
    stage follows (``vae.encode`` of an input image) stays loaded from there to that stage.
    """

    def __init__(
        self,
        path: Path,
        classes: Mapping[str, type],
        skeletons: Mapping[str, nn.Module],
        plan: Mapping[str, list[str]],
        keep: Iterable[str],
        *,
        device: torch.device,
        torch_dtype: torch.dtype | None,
        model_kwargs: Mapping[str, Any],
        events: EventSink | None,
        budget: int | str | None = None,
        prefetch: bool = False,
        sizes: Mapping[str, int] | None = None,
        adaptive: bool = False,
        stamps: Mapping[str, dict[Path, Stamp | None]] | None = None,
    ) -> None:
        self.path = path
        # Each component's files as the build found them, until its first load checks them.
        self._stamps = dict(stamps or {})
        self.adaptive = adaptive
        self.device = device
        self.torch_dtype = torch_dtype
        self.plan = {stage: tuple(names) for stage, names in plan.items()}
        self._classes = dict(classes)
        self._skeletons = dict(skeletons)
        self._model_kwargs = dict(model_kwargs)
        self._order = list(self.plan)
        # Where each component goes after every load; pipe.to(...) changes it. "via": for
        # each of "dtypes", the conversion that made it (``.half()``'s, ``.to()``'s), replayed
        # as it is: ``.half()`` leaves a complex tensor complex, ``.to(float16)`` does not.
        self._targets: dict[str, dict[str, Any]] = {
            name: {"device": device, "dtypes": [], "via": [], "other": []}
            for name in self._skeletons
        }
        self._lock = threading.RLock()
        # One call of the pipeline at a time (interim, until calls in flight are counted per
        # module and overlapping calls join one batch): a stage that one call enters would
        # release the models another computes with. Calls of map() hold it as one.
        self.calls = threading.RLock()
        self._in_batch = threading.local()  # set on the threads of map()'s own calls
        self.gather = _Gather(self)  # calls that arrive while one runs: the next batch
        # How each component refills from its files, learned at its first load.
        self._recipes: dict[str, Recipe] = {}
        self._read: set[str] = set()  # loaded through from_pretrained once: said its warnings
        # Which tensors each component's checkpoint holds, and which the user changed.
        self._tracked = {name: _placeholder.Tracked(s) for name, s in self._skeletons.items()}
        self._used: set[str] = set()  # components used at least once, for adaptive plans
        self._bridges: set[tuple[str, str]] = set()  # (stage, name): kept there, not run
        self._closed_at: tuple[str | None] | None = None
        self._gone: set[str] = set()  # components the user replaced on the pipeline
        self._ready: dict[str, str | None] = {}  # name -> the stage of its last full use()
        self._pipeline: weakref.ref[Any] | None = None
        self.models = StagedModels(
            {name: self._loader(name) for name in self._skeletons},
            stages=self.plan,
            pinned=keep,
            events=events,
            budget=budget,
            prefetch=prefetch,
            sizes=sizes,
        )

    @property
    def keep(self) -> frozenset[str]:
        return self.models.pinned

    @property
    def stage(self) -> str | None:
        return self.models.stage

    def _loader(self, name: str) -> Any:
        def load() -> nn.Module:
            if self._closed_at is not None:  # close() is for good, models[name] included
                raise ReleasedModuleError(name, self._closed_at[0], closed=True)
            skeleton = self._skeletons[name]
            # Filling writes the placeholder's tensors; on this thread that must not count as
            # a use of the empty placeholder (which would load it again).
            with _placeholder.passthrough(skeleton), _normal_tensors():
                self._fill(name, skeleton)
            return skeleton

        load.__qualname__ = f"load_{name}"
        # from_pretrained builds on meta (low_cpu_mem_usage, the default with accelerate)
        # and reads weights in: no random numbers drawn, so it may be prefetched.
        if self._model_kwargs.get("low_cpu_mem_usage", True) is not False:
            rng_free(load)
        # Only refills go to the background: from_pretrained's meta set-up reaches other threads.
        setattr(load, BACKGROUND_READY_ATTR, lambda: name in self._recipes)
        return load

    def _fill(self, name: str, skeleton: nn.Module) -> None:
        target = self._targets[name]
        tracked = self._tracked[name]
        _placeholder.check_merges(name, skeleton)
        recipe = self._recipes.get(name)

        def convert(module: nn.Module) -> nn.Module:
            # pipe.to(dtype) and .half() calls since, each as eager did, then
            # .to(memory_format=...)
            for dtype, via in zip(target["dtypes"], target["via"], strict=True):
                if via is not None:
                    module = _placeholder.real_apply(module, via)
                else:
                    module = _placeholder.real_to(module, dtype=dtype)
            for fn in target["other"]:
                module = _placeholder.real_apply(module, fn)
            return module

        if recipe is not None:  # refill in place from the files, as the first load was
            fresh = tracked.empty(skeleton)
            pipe = self._pipeline() if self._pipeline is not None else None
            quiet = pipe is not None and progress_bars_disabled(pipe)  # as the pipeline's bars
            reload(
                skeleton,
                recipe,
                target["device"],
                names=tracked.names(skeleton),
                convert=convert,  # what the files filled: the script's changes had theirs
                name=name,
                progress=not quiet,
            )
            tracked.filled(skeleton, fresh)
            _placeholder.check_added(name, skeleton, tracked)
            return
        check_unchanged(  # its own tensors came from the files as they were
            self._stamps.get(name, {}),
            f"since the staged pipeline was built: {name} would load other weights than "
            f"the ones its build read",
            fix="restore the file, or build the staged pipeline again to use the new one",
        )
        loaded = _load_component(
            self._classes[name],
            self.path / name,
            self.torch_dtype,
            self._model_kwargs,
            quiet=name in self._read,
        )
        self._read.add(name)
        if target["device"].type != "cpu":
            loaded = _placeholder.real_to(loaded, device=target["device"])
        _placeholder.fill(skeleton, convert(loaded), tracked)
        _placeholder.check_added(name, skeleton, tracked)
        self._learn(name, skeleton)

    def _learn(self, name: str, skeleton: nn.Module) -> None:
        """After the first from_pretrained load: may later loads read the files directly?"""
        files = pretrained_checkpoint(self.path / name, self._model_kwargs)
        if self._targets[name]["dtypes"]:
            # from_pretrained's dtype then .to(dtype) rounds twice; a direct read once.
            learned: Recipe | str = "it was converted with .to(dtype) before its first load"
        elif isinstance(files, str):
            learned = files
        else:
            names = self._tracked[name].names(skeleton, unchanged=True)
            learned = learn(skeleton, files, names=names)
        if not isinstance(learned, str):
            self._recipes[name] = learned
        else:
            self.emit(
                Event(NOTE, model=name, note=f"{name} reloads with from_pretrained: {learned}")
            )

    def use(self, name: str) -> None:
        """Make ``name`` ready for a use: enter the stage that runs it next, then load it.

        The stage is the current one if it lists ``name``; otherwise the next stage in plan
        order that does, wrapping around, so a second call of the pipeline starts again at
        ``encode`` and a negative-prompt pass re-enters the stage it needs.
        """
        models = self.models
        # The hook runs before every submodule call: once a use in this stage has made the
        # component ready, the rest of the stage's calls need only see that it still is.
        if (
            self._ready.get(name, "") == models.stage
            and models.is_loaded(name)
            and not models.batch_running
            and self._closed_at is None
        ):
            return
        self._check_replaced()
        if self.adaptive and self._closed_at is None:
            with self._lock:
                self._adapt(name)
        if self.models.batch_running and self._closed_at is None:
            # A call of map(): wait for the stage outside this lock, which the other calls
            # of the batch need while this one is parked (see stageload.batch).
            target = self._next_stage(name)
            if target is not None:
                self.models.enter(target)
        with self._lock:
            if self._closed_at is not None:
                raise ReleasedModuleError(name, self._closed_at[0], closed=True)
            target = self._next_stage(name)
            if target is not None and target != self.models.stage:
                self.models.enter(target)
            self.models[name]
            self._ready[name] = self.models.stage

    def load(self, *names: str) -> None:
        """Load the named components now, in the current stage, without changing stage.

        For changes that read a component's weights while it is not loaded:
        ``fuse_lora``, ``load_textual_inversion``, ``fuse_qkv_projections``, editing a
        weight in place. Load first, then change; the change is kept across every later
        release and reload (docs/diffusers.md, "LoRA and other changes").
        """
        unknown = [n for n in names if n not in self._skeletons]
        if unknown:
            raise ValueError(
                f"load() takes staged component names; {unknown!r} is not one "
                f"(staged: {', '.join(self._skeletons)})"
            )
        for name in names:
            self.models[name]

    def map(self, calls: Iterable[Mapping[str, Any]], *, return_exceptions: bool = False) -> list:
        """Run ``pipe(**kwargs)`` for every dict in ``calls`` stage-major; outputs in order.

        Each component loads once for the whole batch where the plan allows (see
        :meth:`stageload.StagedModels.map`). Each call gets its own shallow copy of the
        pipeline and its own copy of the scheduler, since diffusers keeps per-call state
        on both (``_guidance_scale``, the scheduler's timesteps and step index). With its
        own ``generator=``, each output equals that call run alone, bit for bit.
        """
        pipe = self._pipeline() if self._pipeline is not None else None
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
            self._in_batch.active = True  # this thread's calls are the batch's: no call lock
            try:
                return _own_copy(pipe)(**kwargs)
            finally:
                self._in_batch.active = False

        with self.calls:  # the batch is one call of the pipeline for any other thread
            return self.models.map(one, calls, return_exceptions=return_exceptions)

    def holds(self, name: str, component: nn.Module) -> bool:
        """Whether the pipeline's ``name`` is still ``component`` (not replaced since)."""
        pipe = self._pipeline() if self._pipeline is not None else None
        return pipe is not None and getattr(pipe, name, None) is component

    def begin(self, stage: str) -> None:
        """Enter ``stage`` for a use of one of its resident components, if that use begins it
        (a stage mark's call: see ``_marks``)."""
        models = self.models
        if self._closed_at is not None or not mark_begins(self._order, models.stage, stage):
            return
        if models.batch_running:
            # A call of map(): wait for the stage outside this lock, which the other calls
            # of the batch need while this one is parked (as use() does).
            models.enter(stage)
            return
        with self._lock:
            if self._closed_at is None and models.stage != stage:
                models.enter(stage)

    def move(
        self,
        name: str,
        device: torch.device | None,
        dtype: torch.dtype | None,
        other: Callable[[Any], Any] | None = None,
        via: Callable[[Any], Any] | None = None,
    ) -> None:
        """Take ``component.to(device, dtype)``, or ``other``, a conversion that is more
        than a move (``.to(memory_format=...)``): made now if loaded, and after each load.
        ``via``: the conversion (``nn.Module._apply``'s function) that changes the dtype,
        made itself rather than ``.to(dtype)``: ``.half()`` converts only floating
        tensors, and ``.to(float16)`` made a complex buffer real (dropping its imaginary
        part) where eager's ``.half()`` kept it complex."""
        import torch

        with self._lock:
            skeleton = self._skeletons[name]
            target = self._targets[name]
            hook = _placeholder.stage_hook(skeleton)
            if device is not None:
                target["device"] = torch.device(device)
                if hook is not None:
                    hook.execution_device = target["device"]
            if dtype is not None:
                # Every conversion, in order: fp32 -> bf16 -> fp32 keeps bf16's rounding,
                # as eager's weights do (the last dtype alone would reload unrounded).
                grown = [*target["dtypes"], dtype]
                chain = converted(target["dtypes"], dtype)
                vias = [*target["via"], via]
                span = vias[len(chain) - 1 :]  # the conversions a shorter chain would skip
                if len(chain) < len(grown) and len({_keeps_complex(v) for v in span}) > 1:
                    chain = grown  # a .to() and a .half() in the span: complex tensors differ
                target["dtypes"], target["via"] = chain, vias[: len(chain)]
            fresh_again = other is _placeholder.fresh_copy and other in target["other"]
            if other is not None and not fresh_again:  # a fresh copy once: it is idempotent
                target["other"].append(other)
            if self.models.is_loaded(name):
                tracked = self._tracked[name]
                unchanged = set(tracked.names(skeleton, unchanged=True))
                if other is not None or via is not None:
                    _placeholder.real_apply(skeleton, other or via)
                else:
                    _placeholder.real_to(skeleton, device=device, dtype=dtype)
                # Every later load gets the same conversion: not a change of the user's.
                tracked.filled(skeleton, unchanged)
            elif dtype is not None:  # on meta only the dtype changes now; the device at load
                if via is not None:
                    _placeholder.real_apply(skeleton, via)
                else:
                    _placeholder.real_to(skeleton, dtype=dtype)
                if hook is not None:
                    mark_empty(skeleton, hook)  # converted buffers are new tensors

    def _adapt(self, name: str) -> None:
        """Refine the default plan with this use of ``name`` (see the class docstring)."""
        first_use = name not in self._used
        self._used.add(name)
        change = refine(self.plan, name, self.models.stage, first_use=first_use)
        if change is not None:
            plan, bridges = change
            self._bridges.update((stage, name) for stage in bridges)
            self.plan = plan
            self._order = list(plan)
            self.models.replan(plan)

    def _next_stage(self, name: str) -> str | None:
        current = self.models.stage
        runs_here = current is not None and name in self.plan[current]
        if runs_here and (current, name) not in self._bridges:
            return current
        plan = self.models.plan
        first = plan.next_stage(current) if current is not None else next(iter(plan))
        for stage in plan.cycle(first):
            if name in plan[stage] and (stage, name) not in self._bridges:
                return stage
        return None

    def save(self, name: str, save: Callable[[], Any]) -> Any:
        """Run ``save()`` (the component's own ``save_pretrained``) with ``name`` loaded:
        loaded now if it is not, and released again afterwards, so saving a staged pipeline
        holds one component at a time and leaves loaded only what was loaded before."""
        was_loaded = self.models.is_loaded(name)
        self.models[name]
        try:
            return save()
        finally:
            if not was_loaded and self._closed_at is None:
                self.models.evict(name)

    def _check_replaced(self) -> None:
        """Stop staging a component the user replaced on the pipeline (``pipe.vae = ...``).

        The new module is the user's: it stays as it is, in memory, and is used as given; a
        ``note`` event and a warning say so once, and the plan no longer lists the name.
        """
        pipe = self._pipeline() if self._pipeline is not None else None
        if pipe is None or self._closed_at is not None:
            return
        replaced = [
            n
            for n, sk in self._skeletons.items()
            if n not in self._gone and not _is_component(getattr(pipe, n, None), sk)
        ]
        for name in replaced:
            self._gone.add(name)
            new = getattr(pipe, name, None)
            what = "None" if new is None else f"a {type(new).__qualname__}"
            note = (
                f"{name} was replaced after staging with {what}: it is no longer staged; the "
                f"new module stays in memory as given. To stage it, build the pipeline with "
                f"staged_pipeline(..., {name}=...) left out and its checkpoint in the folder"
            )
            warnings.warn(note, stacklevel=4)
            self.emit(Event(NOTE, model=name, note=note))
            with self._lock:
                if self.models.is_loaded(name):
                    self.models.evict(name)
                plan = {
                    stage: tuple(n for n in names if n != name)
                    for stage, names in self.plan.items()
                }
                self.plan = plan
                self.models.replan(plan)

    def _save_through(self, name: str, skeleton: nn.Module) -> None:
        """The placeholder's ``save_pretrained`` saves the loaded component (see :meth:`save`)."""

        def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(inner)
            def save_pretrained(*args: Any, **kwargs: Any) -> Any:
                return self.save(name, lambda: inner(*args, **kwargs))

            return save_pretrained

        patch(skeleton, "save_pretrained", wrap)

    def emit(self, event: Event) -> None:
        """Send one of the adapter's own events where the registry's go."""
        self.models.emit(event)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.deepcopy(pipe), pickle.dumps(pipe), torch.save(pipe) reach the stager here;
        # its locks, threads and registry cannot be copied, and a copy of the pipeline
        # would hold every component at once.
        raise TypeError(
            "a staged pipeline cannot be copied or pickled: its stager holds the loading "
            "state. Copy or save a component instead (copy.deepcopy(pipe.unet), "
            "pipe.save_pretrained(folder)), or build a second pipeline with staged_pipeline()"
        )

    def close(self) -> None:
        """Release every component; using one afterwards raises ReleasedModuleError."""
        with self._lock:
            if self._closed_at is None:
                self._closed_at = (self.models.stage,)
                self.models.close()

    def __repr__(self) -> str:
        return (
            f"StagedPipeline(stage={self.stage!r}, loaded={self.models.loaded()!r}, "
            f"plan={self.plan!r}, keep={sorted(self.keep)!r})"
        )


def staged_pipeline(
    pipeline_cls: type,
    path: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    torch_dtype: torch.dtype | None = None,
    stages: Mapping[str, Iterable[str]] | None = None,
    keep: Iterable[str] | None = None,
    events: EventSink | None = None,
    budget: int | str | None = None,
    prefetch: bool = False,
    stream: Iterable[str] | str | None = None,
    **from_pretrained_kwargs: Any,
) -> Any:
    """Build ``pipeline_cls`` from ``path`` with its large models loaded per stage.

    Args:
        pipeline_cls: a diffusers pipeline class, e.g. ``QwenImage21Pipeline``.
        path: a folder in the ``save_pretrained`` layout, or a hub id (resolved through
            ``pipeline_cls.download``, so the hub cache and ``HF_HUB_OFFLINE`` apply).
        device: where the models run (default CPU). Loaded models are moved there.
        torch_dtype: passed to every component's ``from_pretrained`` (``dtype=``, the
            spelling diffusers 0.42 and transformers 5 prefer, is taken too).
        stages: ``{stage: [component, ...]}`` in pipeline order. Default: ``encode`` (text
            and image encoders), ``denoise`` (transformer or unet; ``denoise_2`` for
            ``transformer_2``), ``decode`` (VAE), from ``pipeline_cls.model_cpu_offload_seq``.
            Models listed in no stage load with the pipeline and stay.
        keep: staged components never released once loaded. Default: those whose weights
            on disk are under a tenth of the largest staged component's.
        events: a sink (``ListSink``, ``MemoryMeter``) for load, release and stage events.
        budget: keep components loaded across stages while they fit in this much memory
            (bytes, ``"12G"``, ``"80%"``, ``"auto"``), evicting by furthest next use; each
            component's size comes from its safetensors headers (docs/residency.md).
            ``None``: release what the next stage does not list.
        prefetch: with a budget, load the next stage's components in a background thread
            while the current stage computes.
        stream: components to stream block by block from their checkpoint instead of
            loading whole (``["transformer"]``: :func:`stageload.streamed`), for a model
            larger than memory; ``"auto"`` (with ``budget=``) streams each component that
            does not fit the budget on its own. Its parts outside the blocks stay loaded.
        **from_pretrained_kwargs: passed to ``pipeline_cls.from_pretrained``; ``variant``,
            ``use_safetensors``, ``revision``, ``low_cpu_mem_usage`` and ``disable_mmap``
            also reach each staged component (``disable_mmap`` reaches transformers models
            too, which the pipeline's own loader does not pass it to). A component
            passed here (``vae=my_vae``) is used as given and not staged.

    Returns:
        The pipeline, an instance of ``pipeline_cls``; ``pipe.stageload`` is its
        :class:`StagedPipeline` (``.models``, ``.plan``, ``.close()``).

    Example::

        pipe = staged_pipeline(QwenImage21Pipeline, path, torch_dtype=torch.bfloat16,
                               events=ListSink())
        image = pipe("a lighthouse at night", num_inference_steps=20).images[0]
    """
    import torch

    from ..core.rng import preserved_rng

    if _is_auto_pipeline(pipeline_cls):  # AutoPipelineForText2Image: the class it would load
        from diffusers import DiffusionPipeline

        found = _resolve_folder(DiffusionPipeline, path, from_pretrained_kwargs)
        pipeline_cls, from_pretrained_kwargs = _concrete_pipeline(
            pipeline_cls, found, from_pretrained_kwargs
        )
    _check_pipeline_cls(pipeline_cls)
    _check_misspelt(pipeline_cls, from_pretrained_kwargs)
    if "dtype" in from_pretrained_kwargs:  # diffusers >= 0.42 spells it dtype
        if torch_dtype is not None:
            raise TypeError("pass torch_dtype= or dtype=, not both")
        torch_dtype = from_pretrained_kwargs.pop("dtype")
    if torch_dtype is not None and not isinstance(torch_dtype, torch.dtype):
        raise TypeError(
            f"torch_dtype must be one torch.dtype such as torch.bfloat16, got {torch_dtype!r}"
            + (
                "; per-component dtypes are not supported here"
                if isinstance(torch_dtype, dict)
                else ""
            )
        )
    device = _check_device(device)
    if budget is not None:
        parse_budget(budget)  # a bad budget fails here, before anything loads
    folder = _resolve_folder(pipeline_cls, path, from_pretrained_kwargs)

    models = model_components(folder)
    check_fits(pipeline_cls, folder, from_pretrained_kwargs)
    given = {name for name in from_pretrained_kwargs if name in models}
    plan, staged, marks = choose_plan(pipeline_cls, folder, models, given, stages)
    _check_variant(folder, staged, from_pretrained_kwargs)
    streaming = _streamed_names(
        stream, models, staged, folder, torch_dtype, budget, from_pretrained_kwargs
    )
    if streaming:  # streamed components are not staged whole: they begin their stage
        for name in streaming:
            listed = [s for s, names in plan.items() if name in names]
            if len(listed) == 1:
                marks[name] = listed[0]
        plan = {s: [n for n in names if n not in streaming] for s, names in plan.items()}
        staged = [n for n in staged if n not in streaming]
    keep = check_keep(keep, staged, folder)

    dtypes = {name: skeleton_dtype(models[name], folder / name, torch_dtype) for name in staged}
    with preserved_rng():  # building a skeleton may run initialisers that draw numbers
        skeletons = {
            name: _placeholder.build_skeleton(models[name], folder / name, dtypes[name])
            for name in staged
        }
    model_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in _MODEL_KWARGS}
    stamps: dict[str, dict[Path, Stamp | None]] = {}
    with releasing():  # one garbage collection for all the skeletons, not one each
        for name, skeleton in skeletons.items():
            built = {n: t for n, t in _placeholder.own_tensors(skeleton) if not t.is_meta}
            # The skeleton starts out "released": a call that bypasses the stager (a
            # submodule called directly) says so, instead of failing on a meta tensor.
            release(skeleton, name=name, stage=None)
            files = pretrained_checkpoint(folder / name, model_kwargs)
            # Before its own tensors are read: the first load must read the same files.
            stamps[name] = {} if isinstance(files, str) else file_stamps(files, sampled=True)
            _placeholder.keep_own(skeleton, built, files)

    streams = {
        name: _stream_component(
            models[name], folder / name, torch_dtype, device, events, from_pretrained_kwargs, name
        )
        for name in streaming
    }
    with BUILD_LOCK:  # the components left to it build as from_pretrained builds them
        pipe = pipeline_cls.from_pretrained(
            os.fspath(folder),
            **_dtype_kwarg(torch_dtype),
            **skeletons,
            **streams,
            **from_pretrained_kwargs,
        )
    if device.type != "cpu":
        for name, component in pipe.components.items():
            if (
                name not in skeletons
                and name not in streams
                and isinstance(component, torch.nn.Module)
            ):
                component.to(device)

    state = StagedPipeline(
        folder,
        {name: models[name] for name in staged},
        skeletons,
        plan,
        keep,
        device=device,
        torch_dtype=torch_dtype,
        model_kwargs=model_kwargs,
        events=events,
        budget=budget,
        prefetch=prefetch,
        sizes=component_sizes(folder, dtypes, from_pretrained_kwargs.get("variant"))
        if budget is not None
        else None,
        adaptive=stages is None,
        stamps=stamps,
    )
    for name, skeleton in skeletons.items():
        state._save_through(name, skeleton)
        hook = StageHook(
            name,
            _user(state, name),
            _mover(state, name),
            device,
            state._tracked[name],
            functools.partial(state.models.__getitem__, name),
        )
        hook.stager = weakref.ref(state)
        _placeholder.attach(skeleton, hook)
        mark_empty(skeleton, hook)  # released before the hook was there
    _marks.attach(state, pipe.components, marks)  # resident components begin their stage
    pipe.stageload = state
    _serialize_calls(type(pipe))
    _serialize_pipelines_built_on_staged()
    state._pipeline = weakref.ref(pipe)  # for map(); the pipeline owns its stager
    resident = {s: [f"{n} (resident)" for n, at in marks.items() if at == s] for s in state.plan}
    summary = "; ".join(f"{s}: {', '.join([*n, *resident[s]])}" for s, n in state.plan.items())
    note = Event(NOTE, note=f"staged {pipeline_cls.__name__}: {summary}")
    state.emit(note)  # to the sink and, under `stageload meter`, its trace
    return pipe


def _check_misspelt(pipeline_cls: type, kwargs: Mapping[str, Any]) -> None:
    """Raise a TypeError for a keyword close to one of :func:`staged_pipeline`'s own that
    the pipeline does not take either (``budjet="12G"``): it would go on to
    ``from_pretrained``, which only logs that it ignores it (a warning a script's
    ``set_verbosity_error`` hides)."""
    import difflib

    params = inspect.signature(staged_pipeline).parameters.values()
    own = [p.name for p in params if p.kind is p.KEYWORD_ONLY]  # read, not listed again
    taken = set(inspect.signature(pipeline_cls.__init__).parameters)
    for key in kwargs:
        if key in taken:
            continue
        close = difflib.get_close_matches(key, own, n=1, cutoff=0.8)
        if close:
            raise TypeError(
                f"staged_pipeline() got {key}=, which neither it nor {pipeline_cls.__name__} "
                f"takes (from_pretrained would ignore it); did you mean {close[0]}=?"
            )


def _streamed_names(
    stream: Iterable[str] | str | None,
    models: Mapping[str, type],
    staged: list[str],
    folder: Path,
    torch_dtype: torch.dtype | None,
    budget: int | str | None,
    kwargs: Mapping[str, Any],
) -> list[str]:
    """The components ``staged_pipeline(stream=...)`` streams, checked."""
    if stream is None:
        return []
    if isinstance(stream, str) and stream.strip().lower() == "auto":
        if budget is None:
            raise ValueError(
                "stream='auto' streams the components that do not fit the budget on their own; "
                "pass budget= too (e.g. budget='80%'), or name them: stream=['transformer']"
            )
        limit = parse_budget(budget)
        dtypes = {n: skeleton_dtype(models[n], folder / n, torch_dtype) for n in staged}
        sizes = component_sizes(folder, dtypes, kwargs.get("variant"))
        return [n for n in staged if sizes.get(n, 0) > limit]
    streamable = [n for n, cls in models.items() if can_stage(cls)]
    if isinstance(stream, str):
        example = stream if stream in streamable else (streamable or ["transformer"])[-1]
        raise TypeError(f"stream must list component names, e.g. [{example!r}], or be 'auto'")
    names = list(stream)
    for i, name in enumerate(names):
        if name not in streamable:
            raise ValueError(
                f"stream names {name!r}, which is not a model component of this pipeline; "
                f"components: {', '.join(streamable) or '(none)'}"
            )
        if name in names[:i]:
            raise ValueError(f"stream names {name!r} twice; name each component once")
    return names


def _stream_component(
    cls: type,
    folder: Path,
    torch_dtype: torch.dtype | None,
    device: torch.device,
    events: EventSink | None,
    kwargs: Mapping[str, Any],
    name: str,
) -> nn.Module:
    """``name`` built on meta and streamed block by block from its checkpoint files."""
    from ..core.streamed import streamed
    from ..load.placement import MAPPED

    files = pretrained_checkpoint(folder, {k: v for k, v in kwargs.items() if k in _MODEL_KWARGS})
    if isinstance(files, str):
        raise ValueError(f"cannot stream {name!r}: {files}; it needs a safetensors checkpoint")
    dtype = skeleton_dtype(cls, folder, torch_dtype)

    def build() -> nn.Module:
        model = build_empty(cls, folder, dtype)
        if is_transformers_model(cls):
            # Tied as from_pretrained ties them: a T5 stores its embedding once, as
            # shared.weight, and the stream reads the files alone. (A placeholder ties
            # them when it is first filled from a from_pretrained model.)
            model.tie_weights()
        return model

    return streamed(
        build,
        files,
        device=device,
        name=name,
        events=events,
        placement=MAPPED,  # as from_pretrained leaves them: in the file's mmap
    )


@functools.cache
def _serialize_calls(pipeline_cls: type) -> None:
    """Make each call of a ``pipeline_cls`` instance hold the call lock of every stager
    among its components (a :func:`patch` of the class's ``__call__``, for the process's
    life; a pipeline with no staged component calls straight through). The stagers are
    found through the components, so a pipeline made by ``from_pipe`` takes the lock of
    the one it came from."""

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            stagers = [s for s in _stagers(self) if not getattr(s._in_batch, "active", False)]
            if len(stagers) == 1 and not args:  # the usual case: calls that overlap batch
                return stagers[0].gather.call(inner, self, kwargs)
            with contextlib.ExitStack() as held:
                for state in stagers:
                    held.enter_context(state.calls)
                return inner(self, *args, **kwargs)

        return __call__

    patch(pipeline_cls, "__call__", wrap)
    _serialize_changes(pipeline_cls)


#: The pipeline's own methods that change its components' parts or weights (diffusers'
#: LoRA, textual inversion, IP-Adapter and QKV-fusion loaders). Each takes the call lock
#: as a call does: from one thread while another thread's call ran, a LoRA load replaced
#: layers while that call's stage loaded or released the UNet (the load failed with
#: "tensors still on meta", the call with StagedChangeError), where eager gave no error.
_CHANGES = (
    "load_lora_weights",
    "unload_lora_weights",
    "fuse_lora",
    "unfuse_lora",
    "set_adapters",
    "delete_adapters",
    "enable_lora",
    "disable_lora",
    "set_lora_device",
    "load_textual_inversion",
    "unload_textual_inversion",
    "load_ip_adapter",
    "unload_ip_adapter",
    "fuse_qkv_projections",
    "unfuse_qkv_projections",
)


@functools.cache
def _serialize_changes(pipeline_cls: type) -> None:
    """Make each of the :data:`_CHANGES` methods that ``pipeline_cls`` has hold the call
    lock of every stager among its components, as a call does: a change waits for the call
    in flight, and a call for the change (a call of a batch changing its own pipeline,
    from a callback, runs straight through, as its calls do)."""

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)
        def change(self: Any, *args: Any, **kwargs: Any) -> Any:
            stagers = [s for s in _stagers(self) if not getattr(s._in_batch, "active", False)]
            with contextlib.ExitStack() as held:
                for state in stagers:
                    held.enter_context(state.calls)
                return inner(self, *args, **kwargs)

        return change

    for name in _CHANGES:
        if inspect.isfunction(inspect.getattr_static(pipeline_cls, name, None)):
            patch(pipeline_cls, name, wrap)


@functools.cache
def _serialize_pipelines_built_on_staged() -> None:
    """A pipeline built on staged components, of another class (``from_pipe``, or a
    constructor given ``pipe.components``), serializes its calls too: its class is patched
    as its ``__init__`` registers a staged component (``register_modules``, which every
    pipeline's ``__init__`` calls). Before, such a pipeline ran unlocked: calls from two
    threads released models under each other's forward."""
    from diffusers import DiffusionPipeline

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)
        def register_modules(self: Any, **kwargs: Any) -> None:
            inner(self, **kwargs)
            if _stagers(self):
                _serialize_calls(type(self))

        return register_modules

    patch(DiffusionPipeline, "register_modules", wrap)


class _Pending:
    """One call of a staged pipeline waiting to run in the next batch."""

    def __init__(self, inner: Callable[..., Any], pipe: Any, kwargs: Mapping[str, Any]) -> None:
        self.inner, self.pipe, self.kwargs = inner, pipe, kwargs
        #: The caller's grad, inference and autocast modes: the call may run on another
        #: thread (in a batch another call leads), in its caller's modes.
        self.modes = thread_modes()
        self.leads = False  # this call's thread is to run the next batch
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.delivered = False  # result or error set by the batch that ran it


class _Gather:
    """Calls of one stager's pipelines from several threads, run as stage-major batches.

    A call that arrives while none runs runs alone; calls that arrive while a batch runs
    wait and become the next batch, run by the first of them (on its own thread) through
    ``StagedModels.map``: each model loads once per batch, and each call runs on its own
    copy of the pipeline (its scheduler state) with its own random stream, so each output
    equals its call run alone. No call waits behind more than one batch."""

    def __init__(self, state: StagedPipeline) -> None:
        self._state = weakref.ref(state)
        self._mutex = threading.Lock()  # taken by `with` only; waits on the bell (Ctrl-C safe)
        self._bell = Bell()
        self._queue: list[_Pending] = []
        self._running = False
        self.batches: list[int] = []  # the size of each batch run, for tests and benches
        self._local = threading.local()  # inside: this thread runs a call of this stager

    def call(self, inner: Callable[..., Any], pipe: Any, kwargs: Mapping[str, Any]) -> Any:
        if getattr(self._local, "inside", False):  # a pipeline calling another of this
            return inner(pipe, **kwargs)  # stager's (Kandinsky's combined pipelines): direct
        mine = _Pending(inner, pipe, kwargs)
        try:
            with self._mutex:
                self._queue.append(mine)
                if not self._running:
                    self._running = mine.leads = True
                self._bell.ring()  # for wait_for_waiting
            self._bell.wait(self._mutex, lambda: mine.leads or mine.done)
            if not mine.done:
                self._run_next()
        except BaseException:
            self._withdraw(mine)
            raise
        if mine.error is not None:
            raise mine.error
        return mine.result

    def wait_for_waiting(self, n: int, timeout: float | None = None) -> bool:
        """Wait until ``n`` calls wait for the next batch (tests and benches wait for this
        state instead of sleeping); False on timeout."""
        return self._bell.wait(self._mutex, lambda: len(self._queue) >= n, timeout)

    def _withdraw(self, mine: _Pending) -> None:
        """``mine``'s thread was interrupted (Ctrl-C) before a batch took it: out of the
        queue, and if it was to run the next batch, the next in line runs it. (Left there,
        the next batch fell to no thread, and every later call waited for good.)"""
        with self._mutex:
            if mine in self._queue:
                self._queue.remove(mine)
                if mine.leads:
                    if self._queue:
                        self._queue[0].leads = True
                    else:
                        self._running = False
                self._bell.ring()

    def _run_next(self) -> None:
        """Run every queued call as one batch, then hand the turn to the next arrival."""
        batch: list[_Pending] = []
        stopped: BaseException | None = None
        try:
            with self._mutex:  # inside the try: the finally hands the turn on whatever comes
                batch, self._queue = self._queue, []
            state = self._state()
            self.batches.append(len(batch))
            if state is None:
                # The stager is gone (its pipeline was dropped): each call runs alone.
                for pending in batch:
                    self._one(pending)
            elif len(batch) == 1:
                with state.calls:
                    self._one(batch[0])
            else:
                self._many(state, batch)
        except BaseException as exc:
            stopped = exc
            raise
        finally:
            with self._mutex:
                for p in batch:
                    if not p.delivered:
                        self._undelivered(p, len(batch), stopped)
                    p.done = True
                if self._queue:
                    self._queue[0].leads = True  # its thread runs the next batch
                else:
                    self._running = False
                self._bell.ring()

    @staticmethod
    def _undelivered(p: _Pending, size: int, stopped: BaseException | None) -> None:
        """``p`` was in a batch that the thread running it left before ``p`` ended (a
        Ctrl-C there): its own thread raises this, never returns None as a result."""
        why = type(stopped).__name__ if stopped is not None else "it stopped"
        p.error = StageloadError(
            f"this call was in a batch of {size} calls run on another thread, which was "
            f"interrupted ({why}) before the call ended: nothing of it was returned; call "
            f"the pipeline again"
        )

    def _one(self, p: _Pending) -> None:
        self._local.inside = True
        try:
            with entered(p.modes):  # on the leader's thread when the stager is gone
                p.result = p.inner(p.pipe, **p.kwargs)
        except BaseException as exc:  # delivered to the call's own thread
            p.error = exc
        finally:
            p.delivered = True
            self._local.inside = False

    def _many(self, state: StagedPipeline, batch: list[_Pending]) -> None:
        def one(p: _Pending) -> Any:
            state._in_batch.active = True
            try:
                with entered(p.modes):  # the batch's thread took the leader's
                    return p.inner(_own_copy(p.pipe), **p.kwargs)
            finally:
                state._in_batch.active = False

        with state.calls:
            results = state.models.map(one, batch, return_exceptions=True)
        for p, result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                p.error = result
            else:
                p.result = result
            p.delivered = True


def _stagers(pipe: Any) -> list[StagedPipeline]:
    """The stagers of ``pipe``'s staged components, each once, in a fixed order."""
    found: dict[int, StagedPipeline] = {}
    components = getattr(pipe, "components", None)
    for component in (components or {}).values():
        hook = _placeholder.stage_hook(getattr(component, "_orig_mod", component))
        state = hook.stager() if hook is not None and hook.stager is not None else None
        if state is not None:
            found[id(state)] = state
    return [found[k] for k in sorted(found)]


def _is_component(value: Any, skeleton: nn.Module) -> bool:
    """Whether ``value`` on the pipeline is still the staged component: the placeholder, or
    ``torch.compile`` of it (an ``OptimizedModule`` around the same object)."""
    return value is skeleton or getattr(value, "_orig_mod", None) is skeleton


def _normal_tensors() -> Any:
    """Where a load runs: outside any ``inference_mode`` of the caller's, so that the
    weights are normal tensors, as ``from_pretrained`` gives them eagerly (inference
    tensors count no versions and refuse in-place changes later: ``fuse_lora``, an edit)."""
    import torch

    return torch.inference_mode(False)


def _user(state: StagedPipeline, name: str) -> Any:
    def use() -> None:
        state.use(name)

    return use


def _keeps_complex(fn: Callable[[Any], Any] | None) -> bool | None:
    """Whether the conversion ``fn`` leaves a complex tensor complex (``.half()``'s does,
    ``.to(float16)``'s, or None for ``.to(dtype)`` itself, does not); None if it cannot
    say. A chain of conversions is shortened only across ones that agree."""
    import torch

    if fn is None:
        return False
    try:
        return bool(fn(torch.zeros(1, dtype=torch.complex64, device="meta")).is_complex())
    except Exception:  # noqa: BLE001  a conversion that takes no meta tensor: do not shorten
        return None


def _mover(state: StagedPipeline, name: str) -> Any:
    def move(
        device: torch.device | None,
        dtype: torch.dtype | None,
        other: Callable[[Any], Any] | None = None,
        via: Callable[[Any], Any] | None = None,
    ) -> None:
        state.move(name, device, dtype, other, via)

    return move


def _own_copy(pipe: Any) -> Any:
    """A shallow copy of ``pipe`` sharing its components, with its own scheduler copies.

    diffusers keeps per-call state on the pipeline (``self._guidance_scale``,
    ``self._num_timesteps``, ...) and on its scheduler (timesteps, sigmas, the step index,
    multistep history). Calls of a batch interleave at stage changes, and Wan 2.2 changes
    stage inside its denoising loop, so each call runs on its own copy.
    """
    import copy

    from diffusers import SchedulerMixin

    mine = copy.copy(pipe)
    for name, component in pipe.components.items():
        if isinstance(component, SchedulerMixin):
            # Past DiffusionPipeline.__setattr__, which would rewrite the shared config.
            mine.__dict__[name] = copy.deepcopy(component)
    return mine
