"""StagedModels: lazy loads, stage releases, events, errors, and bit-identical seeded runs."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from fixtures.tiny import Block, load_block, save_block
from stageload import ListSink, ModelLoadError, ReleasedModuleError, StagedModels
from stageload.hooks.release import is_released, unmark_released

STAGES = {"encode": ["encoder"], "denoise": ["denoiser"], "decode": ["decoder"]}


@pytest.fixture
def checkpoints(tmp_path):
    return {
        name: save_block(tmp_path / f"{name}.safetensors", seed=i)
        for i, name in enumerate(STAGES_MODELS)
    }


STAGES_MODELS = ["encoder", "denoiser", "decoder"]


def loaders_for(paths, counts=None):
    def make(name):
        def load():
            if counts is not None:
                counts[name] = counts.get(name, 0) + 1
            return load_block(paths[name])

        return load

    return {name: make(name) for name in paths}


def run_pipeline(get, enter=lambda stage: None) -> torch.Tensor:
    """A stub 3-stage pipeline: seed once, fetch each model right before its stage's noise."""
    torch.manual_seed(7)
    x = torch.zeros(2, 32)
    for stage, name in zip(STAGES, STAGES_MODELS, strict=True):
        enter(stage)
        model = get(name)  # fetched before the draw, as real pipelines do
        noise = torch.randn(2, 32)
        x = model(x + noise)
    return x


def test_staged_output_is_bit_identical_to_eager(checkpoints):
    """Reference: eager, the same ``load_block`` loaders (a Block built, then
    ``load_state_dict(load_file(...))``) called up front, in this process; this process's
    default torch threads on both sides."""
    eager_models = {name: load() for name, load in loaders_for(checkpoints).items()}
    eager = run_pipeline(eager_models.__getitem__)
    models = StagedModels(loaders_for(checkpoints), stages=STAGES)
    staged = run_pipeline(models.__getitem__, models.enter)
    assert torch.equal(staged, eager)


def test_without_rng_preservation_the_output_differs(checkpoints):
    """Control: proves the bit-identical test can fail."""
    eager_models = {name: load() for name, load in loaders_for(checkpoints).items()}
    eager = run_pipeline(eager_models.__getitem__)
    models = StagedModels(loaders_for(checkpoints), stages=STAGES, preserve_rng=False)
    staged = run_pipeline(models.__getitem__, models.enter)
    assert not torch.equal(staged, eager)


def test_each_stage_holds_only_its_models_and_events_tell_the_story(checkpoints):
    sink = ListSink()
    counts: dict[str, int] = {}
    models = StagedModels(loaders_for(checkpoints, counts), stages=STAGES, events=sink)
    held = []
    run_pipeline(models.__getitem__, lambda s: (models.enter(s), held.append(models.loaded())))
    assert held == [[], [], []]  # entering releases the previous stage's model
    assert models.loaded() == ["decoder"]
    assert counts == {"encoder": 1, "denoiser": 1, "decoder": 1}
    kinds = [(e.kind, e.model, e.stage) for e in sink.events]
    assert kinds == [
        ("stage", None, "encode"),
        ("load", "encoder", "encode"),
        ("stage", None, "denoise"),
        ("release", "encoder", "denoise"),
        ("load", "denoiser", "denoise"),
        ("stage", None, "decode"),
        ("release", "denoiser", "decode"),
        ("load", "decoder", "decode"),
    ]
    size = sum(t.numel() * 4 for t in Block().state_dict().values())
    assert all(e.bytes == size for e in sink.events if e.kind in ("load", "release"))
    assert all(e.seconds is not None and e.seconds >= 0 for e in sink.events if e.bytes)


def test_access_after_release_reloads_and_old_reference_fails_clearly(checkpoints):
    sink = ListSink()
    models = StagedModels(loaders_for(checkpoints), stages=STAGES, events=sink)
    models.enter("encode")
    old = models["encoder"]
    models.enter("denoise")
    with pytest.raises(ReleasedModuleError, match="'encoder'.*'denoise'"):
        old(torch.zeros(1, 32))
    models.enter("encode")
    new = models["encoder"]
    assert new is not old
    assert new(torch.zeros(1, 32)).shape == (1, 32)
    assert [e.kind for e in sink.events if e.model == "encoder"] == ["load", "release", "reload"]


def test_pinned_models_stay_and_close_releases_everything(checkpoints):
    sink = ListSink()
    with StagedModels(
        loaders_for(checkpoints), stages=STAGES, pinned=["decoder"], events=sink
    ) as models:
        models.enter("encode")
        models["decoder"]
        models["encoder"]
        models.enter("denoise")
        assert models.loaded() == ["decoder"]
    assert models.loaded() == []
    assert [e.model for e in sink.kinds("release")] == ["encoder", "decoder"]


def test_unplanned_access_works_and_is_recorded_once_per_stage(checkpoints):
    sink = ListSink()
    models = StagedModels(loaders_for(checkpoints), stages=STAGES, events=sink)
    models.enter("encode")
    models["decoder"]
    models["decoder"]
    notes = sink.kinds("note")
    assert len(notes) == 1
    assert notes[0].model == "decoder" and notes[0].stage == "encode"
    assert "does not list it" in notes[0].note


def test_membership_length_and_iteration_never_load(checkpoints):
    counts: dict[str, int] = {}
    models = StagedModels(loaders_for(checkpoints, counts), stages=STAGES)
    assert "encoder" in models and "nope" not in models
    assert len(models) == 3
    assert list(models) == STAGES_MODELS
    assert counts == {} and models.loaded() == []


def test_failing_loader_leaves_registry_as_it_was_and_names_model_and_stage(checkpoints):
    sink = ListSink()
    loaders = loaders_for(checkpoints)

    def broken():
        torch.randn(5)  # consumes RNG before failing: must be undone too
        raise FileNotFoundError("denoiser.safetensors")

    loaders["denoiser"] = broken
    models = StagedModels(loaders, stages=STAGES, events=sink)
    models.enter("encode")
    models["encoder"]
    models.enter("denoise")
    before = (models.loaded(), len(sink.events))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(ModelLoadError, match="'denoiser' for stage 'denoise'") as info:
        models["denoiser"]
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert (models.loaded(), len(sink.events)) == before
    assert torch.equal(torch.get_rng_state(), state)


def test_loader_returning_a_non_module_is_a_type_error():
    models = StagedModels({"m": lambda: {"weight": torch.zeros(1)}}, stages={"s": ["m"]})
    with pytest.raises(TypeError, match="'m' returned builtins.dict, not a torch.nn.Module"):
        models["m"]
    assert models.loaded() == []


def test_plan_errors_are_caught_at_construction_and_entry():
    load = {"a": lambda: nn.Linear(1, 1)}
    with pytest.raises(ValueError, match="lists model 'b', which has no loader; .*: a"):
        StagedModels(load, stages={"s": ["a", "b"]})
    with pytest.raises(ValueError, match="pinned model 'c'"):
        StagedModels(load, stages={"s": ["a"]}, pinned=["c"])
    with pytest.raises(TypeError, match="use a list"):
        StagedModels(load, stages={"s": "a"})
    # events=print was taken, and failed at the first event ('no attribute emit').
    with pytest.raises(TypeError, match="events must be an EventSink .*got <built-in function"):
        StagedModels(load, stages={"s": ["a"]}, events=print)
    models = StagedModels(load, stages={"s": ["a"], "t": []})
    with pytest.raises(KeyError, match="unknown stage 'x'; known stages: s, t"):
        models.enter("x")
    with pytest.raises(KeyError, match="no model named 'z'"):
        models["z"]


def test_reentering_the_current_stage_is_a_no_op(checkpoints):
    sink = ListSink()
    models = StagedModels(loaders_for(checkpoints), stages=STAGES, events=sink)
    models.enter("encode")
    models["encoder"]
    models.enter("encode")
    assert [e.kind for e in sink.events] == ["stage", "load"]


def test_shared_storage_between_loaded_models_survives_a_release():
    backbone = nn.Linear(8, 8)
    loaders = {
        "a": lambda: nn.Sequential(backbone, nn.Linear(8, 2)),
        "b": lambda: nn.Sequential(backbone, nn.Linear(8, 3)),
    }
    models = StagedModels(loaders, stages={"both": ["a", "b"], "only_b": ["b"]})
    models.enter("both")
    models["a"]
    b = models["b"]
    x = torch.randn(4, 8)
    expected = b(x)
    models.enter("only_b")
    assert torch.equal(b(x), expected)


def test_a_custom_residency_policy_decides_what_goes(checkpoints):
    class KeepEverything:
        def to_release(self, stage, loaded, plan):
            return []

        def to_prefetch(self, stage, loaded, plan):
            return [n for n in plan.stages[stage] if n not in loaded]

    models = StagedModels(loaders_for(checkpoints), stages=STAGES, policy=KeepEverything())
    models.enter("encode")
    assert models.loaded() == ["encoder"]  # prefetched on entry
    models.enter("denoise")
    assert models.loaded() == ["encoder", "denoiser"]


def test_a_custom_policys_loads_ahead_happen_with_prefetch_on_too(checkpoints):
    """With ``prefetch=True``, the loads ahead a custom policy names whose loaders may not
    run in the background (not marked rng_free) load on entry, on this thread, as without
    prefetch. (They were dropped: Pixal3D's shared backbone, loaded ahead so that its four
    extractors share it, was built inside each of them.)"""

    class LoadAhead:
        def to_release(self, stage, loaded, plan):
            return []

        def to_prefetch(self, stage, loaded, plan):
            return [n for n in plan.stages[stage] if n not in loaded]

    models = StagedModels(
        loaders_for(checkpoints), stages=STAGES, policy=LoadAhead(), prefetch=True
    )
    assert models.prefetch and "encoder" not in models._prefetchable
    models.enter("encode")
    assert models.loaded() == ["encoder"]


def test_load_bytes_count_only_what_the_load_added():
    """A backbone another loaded model already holds is not counted again."""
    backbone = nn.Linear(64, 64)
    loaders = {
        "a": lambda: nn.Sequential(backbone, nn.Linear(64, 2)),
        "b": lambda: nn.Sequential(backbone, nn.Linear(64, 3)),
    }
    sink = ListSink()
    models = StagedModels(loaders, stages={"both": ["a", "b"], "none": []}, events=sink)
    models.enter("both")
    models["a"]
    models["b"]
    models.enter("none")
    size = lambda m: sum(t.numel() * 4 for t in m.state_dict().values())  # noqa: E731
    loads = {e.model: e.bytes for e in sink.kinds("load")}
    assert loads == {"a": size(backbone) + size(nn.Linear(64, 2)), "b": size(nn.Linear(64, 3))}
    assert sum(e.bytes for e in sink.kinds("release")) == sum(loads.values())


def test_loader_may_use_another_model_but_a_cycle_is_one_clear_error():
    models: StagedModels
    loaders = {
        "backbone": lambda: nn.Linear(4, 4),
        "head": lambda: nn.Sequential(models["backbone"], nn.Linear(4, 4)),
        "a": lambda: models["b"],
        "b": lambda: models["a"],
    }
    models = StagedModels(loaders, stages={"run": list(loaders)})
    head = models["head"]  # the nested load works
    assert head[0] is models["backbone"] and models.loaded() == ["backbone", "head"]
    with pytest.raises(ModelLoadError, match=r"needs 'a' itself \(a -> b -> a\)") as info:
        models["a"]
    assert len(str(info.value)) < 500  # not one wrapped error per recursion level
    assert models.loaded() == ["backbone", "head"]
    models.enter("run")  # the registry still works: nothing half-loaded is left behind
    assert models["backbone"] is head[0]


def test_a_release_that_frees_nothing_says_who_still_holds_the_model():
    """A model that lives on inside another loaded one frees 0 bytes on release: the event
    says which model still holds it and how much, instead of a bare 0."""
    backbone = nn.Linear(256, 256)  # 257 KiB, held by both models below
    sink = ListSink()
    models = StagedModels(
        {"backbone": lambda: backbone, "head": lambda: nn.Sequential(backbone, nn.Linear(256, 4))},
        stages={"both": ["backbone", "head"], "head": ["head"], "none": []},
        events=sink,
    )
    models.enter("both")
    models["backbone"], models["head"]
    models.enter("head")
    models.enter("none")
    (kept, freed) = sink.kinds("release")
    assert (kept.model, kept.bytes) == ("backbone", 0)
    assert kept.note == "257.0 KiB of its weights stay, still held by 'head'"
    assert freed.model == "head" and freed.bytes > 257 * 1024 and freed.note is None


def test_a_policy_without_the_required_steps_fails_at_construction(checkpoints):
    class Half:
        def to_release(self, stage, loaded, plan):
            return []

    with pytest.raises(TypeError, match="lacks to_prefetch"):
        StagedModels(loaders_for(checkpoints), stages=STAGES, policy=Half())


# -- a change made to a loaded model, dropped by its release ----------------------------------
def changing_models(sink: ListSink) -> StagedModels:
    return StagedModels(
        {"a": lambda: nn.Linear(4, 4), "b": lambda: nn.Linear(4, 4)},
        stages={"x": ["a"], "y": ["b"]},
        events=sink,
    )


def dropped_notes(sink: ListSink) -> list[str]:
    return [e.note for e in sink.kinds("note") if e.note and "its release dropped" in e.note]


CHANGES = {
    "a part added (a LoRA)": (lambda m: setattr(m, "lora", nn.Linear(4, 4)), "parts added"),
    ".half()": (lambda m: m.half(), "weight changed from torch.float32 [4, 4] to"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_the_release_drops_is_said_at_the_reload(change):
    """A new-user helper: a LoRA injected into models["a"], or .half(), was gone after the
    next stage change, silently (0.61 off eager). The loader makes a new model: said in a
    note each time, and a warning once."""
    do, said = CHANGES[change]
    sink = ListSink()
    models = changing_models(sink)
    models.enter("x")
    with torch.no_grad():
        do(models["a"])
    models.enter("y")
    assert dropped_notes(sink) == []  # said when the loader makes a new one, not before
    models.enter("x")
    with pytest.warns(
        UserWarning, match="model 'a' was changed after its load.*" + re.escape(said)
    ):
        models["a"]
    with torch.no_grad():
        do(models["a"])
    models.enter("y")
    models.enter("x")
    models["a"]
    assert len(dropped_notes(sink)) == 2  # the warning was once (pytest fails a second)


def test_an_unchanged_model_or_one_its_loader_refills_says_nothing(recwarn):
    sink = ListSink()
    models = changing_models(sink)
    for _ in range(2):
        models.enter("x")
        models["a"](torch.ones(1, 4))  # calls change nothing
        models.enter("y")
    kept = nn.Linear(4, 4)  # an adapter's loader: it refills the object it made, changes too

    def refill() -> nn.Module:
        if is_released(kept):  # the refill puts the change back (the adapters replay theirs)
            kept.weight = nn.Parameter(torch.zeros(4, 4))
            kept.bias = nn.Parameter(torch.zeros(4))
            unmark_released(kept)
        return kept

    models = StagedModels(
        {"a": refill, "b": nn.Identity}, stages={"x": ["a"], "y": ["b"]}, events=sink
    )
    models.enter("x")
    models["a"].lora = nn.Linear(4, 4)
    models.enter("y")
    models.enter("x")
    models["a"]
    assert dropped_notes(sink) == [] and not recwarn.list


def test_the_warning_raised_as_an_error_leaves_the_model_loaded():
    """Under ``-W error`` the warning raises at ``models[name]``: the model it tells of is
    registered first, so the next access returns it, with no second load."""
    sink = ListSink()
    models = changing_models(sink)
    models.enter("x")
    models["a"].lora = nn.Linear(4, 4)
    models.enter("y")
    models.enter("x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="changed after its load"):
            models["a"]
    assert models.loaded() == ["a"]
    models["a"]
    assert [e.kind for e in sink.events if e.model == "a"].count("reload") == 1
