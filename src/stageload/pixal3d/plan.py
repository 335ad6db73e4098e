"""The stage plan for the Pixal3D-mac port's 1024_cascade pipeline.

Stage names follow the port's run: ``setup`` is everything before the first stage (the
pipeline is built there, without weights), then one stage per step of ``run()``.
Light on purpose: the CLI imports it for ``--help``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import StageloadError

#: The ways to load: stageload's staged build, the port's own under ``stageload.auto``
#: (its stages as the plan), or the port's own unstaged.
LOADS: tuple[str, ...] = ("staged", "auto", "eager")

#: The pipeline's eight models, as keys of ``pipeline.models``.
MODEL_NAMES: tuple[str, ...] = (
    "sparse_structure_flow_model",
    "sparse_structure_decoder",
    "shape_slat_flow_model_512",
    "shape_slat_flow_model_1024",
    "shape_slat_decoder",
    "tex_slat_flow_model_512",  # 1536_cascade only; 1024_cascade never loads it
    "tex_slat_flow_model_1024",
    "tex_slat_decoder",
)

#: The feature extractors (pipeline attributes, also their staged names) -> their stage.
EXTRACTOR_STAGES: dict[str, str] = {
    "image_cond_model_ss": "structure",
    "image_cond_model_shape_512": "shape_512",
    "image_cond_model_shape_1024": "shape_1024",
    "image_cond_model_tex_1024": "texture",
}

#: ``IMAGE_COND_CONFIGS`` key of each extractor in ``generate_mps.py``.
EXTRACTOR_KEYS: tuple[str, ...] = ("ss", "shape_512", "shape_1024", "tex_1024")

#: The DINOv3 backbone all four extractors share, and the NAF upsampler three of them
#: share. Each is a staged entry of its own, listed in every extractor stage, so that
#: releasing one extractor keeps what the next one still needs.
BACKBONE = "image_cond_backbone"
NAF = "image_cond_naf"

#: Background removal, used by ``preprocess_image`` only.
REMBG = "rembg_model"

#: Stages in the order the port runs them.
STAGES: tuple[str, ...] = (
    "setup",
    "preprocess",
    "camera",
    "structure",
    "shape_512",
    "shape_1024",
    "texture",
    "decode",
    "export",
)

_SHARED = (BACKBONE, NAF)

#: What each stage of 1024_cascade keeps in memory. The shape decoder is needed twice:
#: in shape_512 to upsample the coordinates, and again to decode.
PLAN_1024_CASCADE: dict[str, tuple[str, ...]] = {
    "setup": (),
    "preprocess": (REMBG,),
    "camera": (),
    "structure": (
        "sparse_structure_flow_model",
        "sparse_structure_decoder",
        "image_cond_model_ss",
        *_SHARED,
    ),
    "shape_512": (
        "shape_slat_flow_model_512",
        "shape_slat_decoder",
        "image_cond_model_shape_512",
        *_SHARED,
    ),
    "shape_1024": ("shape_slat_flow_model_1024", "image_cond_model_shape_1024", *_SHARED),
    "texture": ("tex_slat_flow_model_1024", "image_cond_model_tex_1024", *_SHARED),
    "decode": ("shape_slat_decoder", "tex_slat_decoder"),
    "export": (),
}

PLANS: dict[str, dict[str, tuple[str, ...]]] = {"1024_cascade": PLAN_1024_CASCADE}


class UnsupportedPipelineError(StageloadError, ValueError):
    """The port's pipeline type has no stage plan here."""

    def __init__(self, pipeline_type: object) -> None:
        self.pipeline_type = pipeline_type
        super().__init__(
            f"pipeline type {pipeline_type!r} has no stage plan in stageload.pixal3d; "
            f"supported: {', '.join(PLANS)}. Pass --pipeline-type 1024_cascade, or run "
            "that pipeline with the port's own generate_mps.py"
        )


def plan_for(pipeline_type: str) -> dict[str, tuple[str, ...]]:
    """The stage plan for ``pipeline_type``; raises :class:`UnsupportedPipelineError`."""
    plan = PLANS.get(pipeline_type)
    if plan is None:
        raise UnsupportedPipelineError(pipeline_type)
    return dict(plan)


def run_stages(pipeline: Any, pipeline_type: str | None = None) -> list[list[Any]]:
    """The objects a call of the port's ``Pixal3DImageTo3DPipeline.run`` uses, stage by
    stage in the plan's order: ``pipeline.models[name]``, each extractor with its DINOv3
    backbone (``.model``) and NAF upsampler (``.upsampler``), the background remover.
    ``stageload.auto``'s plan for the call; empty for a type without a plan here."""
    plan = PLANS.get(pipeline_type or getattr(pipeline, "default_pipeline_type", None))
    if plan is None:
        return []
    models = getattr(pipeline, "models", None) or {}
    extractor = {stage: getattr(pipeline, attr, None) for attr, stage in EXTRACTOR_STAGES.items()}
    stages: list[list[Any]] = []
    for stage, names in plan.items():
        objects: list[Any] = []
        for name in names:
            if name == BACKBONE:
                objects.append(getattr(extractor.get(stage), "model", None))
            elif name == NAF:
                objects.append(getattr(extractor.get(stage), "upsampler", None))
            elif name in EXTRACTOR_STAGES or name == REMBG:
                objects.append(getattr(pipeline, name, None))
            else:
                objects.append(models.get(name))
        stages.append(objects)
    return stages


def check_stream(names: Iterable[str]) -> tuple[str, ...]:
    """The models ``--stream`` names, each one of :data:`MODEL_NAMES` (else ValueError
    listing them), in order, without repeats."""
    if isinstance(names, str):
        raise TypeError(f"stream must list model names, e.g. [{names!r}]")
    found: list[str] = []
    for name in names:
        if name not in MODEL_NAMES:
            raise ValueError(
                f"stream names {name!r}, which is not one of the pipeline's models; "
                f"models: {', '.join(MODEL_NAMES)}"
            )
        if name not in found:
            found.append(name)
    return tuple(found)
