"""The stage plan of a diffusers pipeline: which component each stage uses, from each
component's role (by name) in ``model_index.json``, ordered by the pipeline class's
``model_cpu_offload_seq`` where it lists them; refined by what the pipeline then does."""

from __future__ import annotations

import importlib
import itertools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.plan import Plan
from ..load.skeleton import can_stage

#: Stage names of the default plan, in pipeline order (``denoise_2`` etc. follow ``denoise``).
ENCODE, DENOISE, DECODE = "encode", "denoise", "decode"
_KINDS = (ENCODE, DENOISE, DECODE)

#: Components under this fraction of the largest staged component stay loaded by default.
SMALL_FRACTION = 0.1
#: Model components under this fraction of the largest one are not staged at all: they
#: load with the pipeline (a projection layer of a few KB beside a 3 GB denoiser).
STAGE_FRACTION = 0.01

# Roles by name (and class, for autoencoders). Components of a sub-pipeline carry its name
# as a prefix ("prior_text_encoder", "prior_prior" in Kandinsky's and Stable Cascade's
# combined pipelines) and get stages of their own, before the main pipeline's.
_GROUP = re.compile(r"^(prior)_(?=.)")
# The denoiser proper, optionally numbered (Wan 2.2's transformer_2 runs the low-noise
# steps); Stable Cascade's denoiser is its "decoder", Kandinsky's and Cascade's "prior".
_DENOISER = re.compile(r"^(transformer|unet|prior|decoder)(?:_(\d+))?$")
# Models that run beside the denoiser within each step.
_HELPER = re.compile(r"controlnet|adapter")
# Models that turn latents into the output: autoencoders and vocoders.
_AUTOENCODER_NAMES = ("vae", "movq", "vqgan", "vocoder", "audio_vae")
_AUTOENCODER_CLASSES = ("Autoencoder", "VQModel", "PaellaVQModel", "AsymmetricAutoencoder")

ENCODER, DENOISER, HELPER, DECODER = "encoder", "denoiser", "helper", "decoder"
FLOATING = "floating"


def split_group(name: str) -> tuple[str, str]:
    """``"prior_text_encoder"`` -> ``("prior", "text_encoder")``; ``"vae"`` -> ``("", "vae")``."""
    match = _GROUP.match(name)
    return (match.group(1), name[match.end() :]) if match else ("", name)


def role(name: str, cls: type) -> str:
    """What a component does in the pipeline, from its name (and class, for autoencoders).

    ``floating`` means unknown: such a component joins the stage in which it is first used.
    """
    _, bare = split_group(name)
    if (
        bare in _AUTOENCODER_NAMES
        or bare.startswith("vae")
        or cls.__name__.startswith(_AUTOENCODER_CLASSES)
    ):
        return DECODER
    if _DENOISER.match(bare):
        return DENOISER
    if _HELPER.search(bare):
        return HELPER
    if "encoder" in bare:
        return ENCODER
    return FLOATING


def stage_name(group: str, kind: str, number: int = 1) -> str:
    base = kind if number == 1 else f"{kind}_{number}"
    return f"{group}_{base}" if group else base


def stage_kind(stage: str) -> tuple[str, str]:
    """``"prior_denoise_2"`` -> ``("prior", "denoise")``; unknown names -> ``("", "")``."""
    group, bare = split_group(stage)
    kind = bare.rsplit("_", 1)[0] if bare.rsplit("_", 1)[-1].isdigit() else bare
    return (group, kind) if kind in _KINDS else ("", "")


def read_index(path: Path) -> dict[str, tuple[str, str]]:
    """Components of a saved pipeline: name -> (library, class name), skipping empty slots."""
    index_file = path / "model_index.json"
    try:
        index = json.loads(index_file.read_text())
    except FileNotFoundError:
        hint = (
            f" (it is a component's folder: pass its parent, {str(path.parent)!r})"
            if (path.parent / "model_index.json").is_file()
            else ""
        )
        raise FileNotFoundError(
            f"{str(path)!r} has no model_index.json{hint}; pass a folder written by "
            f"pipeline.save_pretrained() or a hub id"
        ) from None
    out: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library, class_name = value
        if library is None or class_name is None:
            continue
        out[name] = (library, class_name)
    return out


def component_class(library: str, class_name: str) -> Any:
    """Import the class a ``model_index.json`` entry names, or None if it can't be found."""
    import sys

    module = sys.modules.get(library)
    if module is None and library in ("diffusers", "transformers"):
        module = importlib.import_module(library)
    if module is None:
        try:
            diffusers_pipelines = importlib.import_module("diffusers.pipelines")
            module = getattr(diffusers_pipelines, library, None)
        except ImportError:
            module = None
    return getattr(module, class_name, None) if module is not None else None


def model_components(path: Path) -> dict[str, type]:
    """The components of the checkpoint at ``path`` that are models (``nn.Module`` classes
    with ``from_pretrained``), name -> class, in ``model_index.json`` order."""
    from torch import nn

    out: dict[str, type] = {}
    for name, (library, class_name) in read_index(path).items():
        cls = component_class(library, class_name)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "from_pretrained"):
            out[name] = cls
    return out


def check_fits(pipeline_cls: type, path: Path, given: Iterable[str]) -> None:
    """Raise a ValueError before any loading when the checkpoint at ``path`` lacks a
    component that ``pipeline_cls`` requires and the caller did not pass it."""
    import inspect

    index = json.loads((path / "model_index.json").read_text())
    params = inspect.signature(pipeline_cls.__init__).parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return  # DiffusionPipeline itself: the checkpoint names the class
    required = [
        name
        for name, p in params.items()
        if name != "self" and p.default is inspect.Parameter.empty
    ]
    optional = set(getattr(pipeline_cls, "_optional_components", None) or ())
    present = {k for k in index if not k.startswith("_")} | set(given)
    missing = [name for name in required if name not in present and name not in optional]
    if missing:
        saved = index.get("_class_name", "?")
        raise ValueError(
            f"{str(path)!r} holds a {saved} checkpoint without {', '.join(map(repr, missing))}, "
            f"which {pipeline_cls.__name__} needs; pass the pipeline class it was saved from "
            f"({saved}) or give the missing components as arguments ({missing[0]}=...)"
        )


def weight_bytes(path: Path, names: Iterable[str]) -> dict[str, int]:
    """Bytes of weight files on disk per component folder."""
    out: dict[str, int] = {}
    for name in names:
        folder = path / name
        files = [*folder.glob("*.safetensors"), *folder.glob("*.bin")] if folder.is_dir() else []
        out[name] = sum(f.stat().st_size for f in files)
    return out


def component_sizes(
    path: Path, dtypes: Mapping[str, Any], variant: str | None = None
) -> dict[str, int]:
    """Bytes each component takes once loaded as ``dtypes[name]``, from its safetensors
    headers alone (no weights read). A component without safetensors files is left out:
    its size is learned at its first load."""
    from ..load.checkpoint import checkpoint_bytes

    out: dict[str, int] = {}
    for name, dtype in dtypes.items():
        files = []
        for file in sorted((path / name).glob("*.safetensors")):
            stem = file.name[: -len(".safetensors")].split("-0")[0]  # shards: name-00001-of-...
            has = "." in stem
            if (variant is None and not has) or (variant and stem.endswith(f".{variant}")):
                files.append(file)
        if files:
            float_dtype = dtype if getattr(dtype, "is_floating_point", False) else None
            try:
                out[name] = checkpoint_bytes(files, dtype=float_dtype)
            except (OSError, ValueError):
                continue  # an unusual header: the first load measures it instead
    return out


def default_plan(seq: str | None, models: Mapping[str, type]) -> dict[str, list[str]]:
    """The stages each component is known to belong to before the pipeline runs.

    Per group (``prior_`` components first, then the rest): ``encode`` (the encoders),
    ``denoise`` (one stage per denoiser, so Wan 2.2's ``transformer_2`` replaces
    ``transformer`` mid-loop; controlnets and adapters join each), ``decode`` (VAE, VQ
    models, vocoders). ``model_cpu_offload_seq`` only orders components; one it omits is
    staged all the same. Components of unknown role are left out: they join the stage in
    which the pipeline first uses them (see ``StagedPipeline.use``).
    """
    listed = [n.strip() for n in seq.split("->")] if seq else []
    order = [n for n in listed if n in models] + [n for n in models if n not in listed]
    groups: dict[str, dict[str, list[str]]] = {}
    for name in order:
        group, bare = split_group(name)
        kinds = groups.setdefault(group, {ENCODER: [], DENOISER: [], HELPER: [], DECODER: []})
        which = role(name, models[name])
        if which != FLOATING:
            kinds[which].append(name)
    plan: dict[str, list[str]] = {}
    for group in sorted(groups, key=lambda g: g == ""):  # sub-pipelines run first
        kinds = groups[group]
        if kinds[ENCODER]:
            plan[stage_name(group, ENCODE)] = kinds[ENCODER]
        denoisers = kinds[DENOISER]
        numbers: list[int] = []
        for name in denoisers:  # transformer_2 -> 2; unnumbered ones count up from 1
            match = _DENOISER.match(split_group(name)[1])
            wanted = int(match.group(2)) if match and match.group(2) else 1
            while wanted in numbers:
                wanted += 1
            numbers.append(wanted)
        for number, name in sorted(zip(numbers, denoisers, strict=True)):
            plan[stage_name(group, DENOISE, number)] = [name, *kinds[HELPER]]
        if not denoisers and kinds[HELPER]:
            plan[stage_name(group, DENOISE)] = list(kinds[HELPER])
        if kinds[DECODER]:
            plan[stage_name(group, DECODE)] = kinds[DECODER]
    return plan


def choose_plan(
    pipeline_cls: type,
    folder: Path,
    models: Mapping[str, type],
    given: Iterable[str],
    stages: Mapping[str, Iterable[str]] | None,
) -> tuple[dict[str, list[str]], list[str], dict[str, str]]:
    """The plan, every staged component (those of unknown role too, which the default
    plan lists once the pipeline first uses them), and the marks: each loaded-and-kept
    component of known role with the one stage whose start its first use marks
    (``{"vae": "decode"}``). ``given``: components passed as objects (never marked).

    With the default plan, a role's stage is in the plan even when none of its components
    is staged (``"decode": []`` beside a 41 GB transformer), so that the stage shows in
    traces and reports; entering it releases what it does not list, as any stage does.
    A ``stages=`` plan is the caller's: no stages added, no marks.
    """
    given = set(given)
    if stages is not None:
        plan = check_stages(stages, models)
        clash = given & {n for names in plan.values() for n in names}
        if clash:
            raise ValueError(
                f"{sorted(clash)!r} passed as objects and listed in stages=; a component given "
                f"to from_pretrained is used as is, so leave it out of the plan"
            )
        return plan, list(dict.fromkeys(n for names in plan.values() for n in names)), {}
    candidates = [name for name, cls in models.items() if name not in given and can_stage(cls)]
    worth = staged_components(weight_bytes(folder, candidates))
    seq = getattr(pipeline_cls, "model_cpu_offload_seq", None)
    # The plan of every component the pipeline loads, then only the staged ones listed.
    full = default_plan(seq, {name: cls for name, cls in models.items() if name not in given})
    plan = {stage: [n for n in names if n in worth] for stage, names in full.items()}
    planned = [n for names in plan.values() for n in names]
    return (
        plan,
        [*dict.fromkeys(planned), *(n for n in worth if n not in planned)],
        marks(full, worth),
    )


def marks(plan: Mapping[str, Iterable[str]], staged: Iterable[str]) -> dict[str, str]:
    """Components of ``plan`` that are not staged, each with the stage that lists it. One
    listed in several stages (a controlnet beside ``denoise`` and ``denoise_2``) marks none:
    its use says nothing about which of them runs."""
    where: dict[str, list[str]] = {}
    for stage, names in plan.items():
        for name in names:
            where.setdefault(name, []).append(stage)
    staged = set(staged)
    return {n: s[0] for n, s in where.items() if n not in staged and len(s) == 1}


def mark_begins(order: Sequence[str], current: str | None, stage: str) -> bool:
    """Whether a use of a component marking ``stage``, in stage ``current``, begins it.

    Not when a denoising stage of its group lies ahead of ``current`` before ``stage``
    (plan taken as a cycle): ``vae.encode`` of an input image before denoising belongs to
    the stage it runs in, as ``refine`` decides for a staged VAE.
    """
    if current == stage:
        return False
    cycle = Plan(dict.fromkeys(order, ()))
    start = order[0] if current is None else cycle.next_stage(current)
    between = list(itertools.takewhile(lambda s: s != stage, cycle.cycle(start)))
    group = stage_kind(stage)[0]
    return not any(stage_kind(s) == (group, DENOISE) for s in between)


def staged_components(sizes: Mapping[str, int], *, fraction: float = STAGE_FRACTION) -> list[str]:
    """The components worth staging: all but those under ``fraction`` of the largest."""
    if not sizes:
        return []
    largest = max(sizes.values())
    return [name for name, size in sizes.items() if size >= fraction * largest]


StagePlan = dict[str, tuple[str, ...]]


def refine(
    plan: Mapping[str, tuple[str, ...]], name: str, current: str | None, *, first_use: bool
) -> tuple[StagePlan, list[str]] | None:
    """The default plan after the pipeline uses ``name`` in stage ``current`` (``None``
    before any stage), or ``None`` if it stays as it is; with the plan, the stages where
    ``name`` is now only kept loaded between two uses (bridges).

    - A component of unknown role joins the stage where it is first used (AudioLDM2's
      GPT-2 and projection join ``encode``).
    - One first used after its planned stage moves to where it runs (Kandinsky's prior
      encodes a zero image after its denoising loop).
    - One used before the denoiser that its planned stage follows (``vae.encode`` of an
      input image in img2img, inpainting, SVD) joins the current stage and stays loaded
      until its planned stage, rather than loading twice per call.
    """
    order = list(plan)
    if current is None and not order:
        return {"run": (name,)}, []
    here = current if current is not None else order[0]
    at = order.index(here)
    listed = [i for i, stage in enumerate(order) if name in plan[stage]]
    if not listed:
        return _with(plan, name, [here]), []
    if name in plan[here]:
        return None
    if first_use and current is not None and listed[-1] < at:
        moved = {stage: tuple(n for n in names if n != name) for stage, names in plan.items()}
        return _with(moved, name, [here]), []
    ahead = [i for i in listed if i > at]
    if not ahead:
        return None  # only earlier stages list it: the next call has begun
    between = order[at + 1 : ahead[0]]
    target_group = stage_kind(order[ahead[0]])[0]
    before_denoising = stage_kind(here) != (target_group, DENOISE) and any(
        stage_kind(stage) == (target_group, DENOISE) for stage in between
    )
    if not before_denoising:
        return None
    return _with(plan, name, [here, *between]), between


def _with(plan: Mapping[str, tuple[str, ...]], name: str, stages: Iterable[str]) -> StagePlan:
    out = {stage: tuple(names) for stage, names in plan.items()}
    for stage in stages:
        if name not in out[stage]:
            out[stage] = (*out[stage], name)
    return out


def check_stages(stages: Any, models: Mapping[str, type]) -> dict[str, list[str]]:
    """Validate a user's ``stages=`` against the checkpoint's components (component names,
    not loaders: ``core.plan.check_plan`` validates the plan ``StagedModels`` is given)."""
    if not isinstance(stages, Mapping):
        raise TypeError(
            f"stages must map each stage to the components it uses, e.g. "
            f"{{'encode': ['text_encoder'], 'denoise': ['transformer'], 'decode': ['vae']}}; "
            f"got {stages!r}"
        )
    if not stages:
        raise ValueError(
            f"stages is empty ({stages!r}): list at least one stage, e.g. "
            f"{{'encode': ['text_encoder'], 'denoise': ['transformer'], 'decode': ['vae']}}, or "
            f"leave stages out for the default plan"
        )
    plan: dict[str, list[str]] = {}
    for stage, names in stages.items():
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise TypeError(
                f"stage {stage!r} must list component names, e.g. [{names!r}]; got {names!r}"
            )
        names = list(names)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"stage {stage!r} lists {twice[0]!r} more than once ({names!r}); list each "
                f"component once per stage"
            )
        for name in names:
            if name not in models:
                raise ValueError(
                    f"stage {stage!r} lists {name!r}, which is not a model component of this "
                    f"checkpoint; its models are: {', '.join(models) or '(none)'}"
                )
        plan[str(stage)] = names
    return plan


def default_keep(sizes: Mapping[str, int], *, fraction: float = SMALL_FRACTION) -> list[str]:
    """Staged components small next to the largest (the VAE beside a 16 GB text encoder):
    reloading them every call would cost time and save little memory."""
    if not sizes:
        return []
    largest = max(sizes.values())
    return [name for name, size in sizes.items() if size < fraction * largest]
