"""The Plan: stages in order, the cycle, next stage, next use of a model, validation."""

from __future__ import annotations

import pytest

from stageload import Plan, StagedModels
from stageload.core.plan import check_plan
from stageload.core.policy import FurthestNextUse, PolicyView

STAGES = {"encode": ["text"], "denoise": ["unet"], "decode": ["vae"], "refine": ["unet"]}


def test_a_plan_is_the_stages_in_order_as_a_read_only_mapping():
    plan = Plan(STAGES)
    assert list(plan) == ["encode", "denoise", "decode", "refine"] == list(plan.order)
    assert plan["denoise"] == ("unet",)
    assert plan == {k: tuple(v) for k, v in STAGES.items()}
    assert plan.models() == ["text", "unet", "vae"]
    assert plan.listed("vae") and not plan.listed("lora")


def test_the_next_stage_cycles_and_next_use_counts_around_the_cycle():
    plan = Plan(STAGES)
    assert plan.next_stage("denoise") == "decode"
    assert plan.next_stage("refine") == "encode"  # after the last, the first
    assert list(plan.cycle("decode")) == ["decode", "refine", "encode", "denoise"]
    assert list(plan.cycle("refine", 6)) == [
        "refine",
        "encode",
        "denoise",
        "decode",
        "refine",
        "encode",
    ]
    assert plan.next_use("unet", "denoise") == 0
    assert plan.next_use("unet", "decode") == 1  # refine
    assert plan.next_use("text", "decode") == 2  # refine, then encode
    assert plan.next_use("lora", "encode") == float("inf")


def test_an_unknown_stage_names_the_known_ones():
    with pytest.raises(KeyError, match="known stages: encode, denoise, decode, refine"):
        Plan(STAGES).next_stage("upscale")


def test_check_plan_validates_once_for_every_user_of_the_plan():
    loaders = dict.fromkeys(["text", "unet", "vae"], lambda: None)
    assert isinstance(check_plan(loaders, STAGES, ["vae"]), Plan)
    with pytest.raises(ValueError, match="stage 'decode' lists model 'vae', which has no loader"):
        check_plan({"text": loaders["text"], "unet": loaders["unet"]}, STAGES, ())
    with pytest.raises(TypeError, match="as a string; use a list"):
        check_plan(loaders, {"encode": "text"}, ())
    with pytest.raises(ValueError, match="pinned model 'lora' has no loader"):
        check_plan(loaders, STAGES, ["lora"])
    # A new-user helper's slips: "pinned model 'v' has no loader" for pinned="vae", and a
    # model given as its own loader, which failed at its first use with a forward's error.
    with pytest.raises(TypeError, match=r"got the string 'vae': use \['vae'\]"):
        check_plan(loaders, STAGES, "vae")
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"loader for 'vae' is a model \(Linear\).*from_safet"):
        check_plan({**loaders, "vae": torch.nn.Linear(2, 2)}, STAGES, ())


def test_staged_models_and_the_policies_ask_the_same_plan():
    models = StagedModels(dict.fromkeys(["text", "unet", "vae"], lambda: None), stages=STAGES)
    assert models.stages == {k: tuple(v) for k, v in STAGES.items()}  # a dict, as before
    assert models.plan.next_stage("refine") == "encode"
    view = PolicyView(stages=STAGES, pinned=frozenset(), sizes={"text": 1, "unet": 4, "vae": 2})
    assert isinstance(view.stages, Plan)  # a mapping given is made a Plan
    # Belady over the cycle: from decode, text (next used 2 stages on) goes before unet (1).
    assert FurthestNextUse(6).victims("decode", ["text", "unet"], view) == ["text"]
