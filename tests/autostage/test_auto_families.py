"""``stageload.auto`` on every diffusers family of ``stageload.testing.families``, each
pipeline loaded by its own ``from_pretrained`` with no line of stageload in the calls:
each component is read at its first use (``from_pretrained`` builds it on ``meta``), two
seeded calls under a budget that holds no component give eager's outputs bit for bit,
and nothing is said but the plan and the budget (no component kept loaded)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from stageload import ListSink  # noqa: E402
from stageload.autostage import _DIFFUSERS_PLAN, auto  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

#: What auto says of every pipeline under a budget of 1 byte; anything else is a finding.
EXPECTED = ("the plan before the first use", "over the budget")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    return tmp_path_factory.mktemp("families")


def same(a: Any, b: Any) -> bool:
    """Bit for bit: tensors, arrays, PIL images, and lists of them."""
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a.tobytes() == b.tobytes()  # numpy arrays, PIL images


def two_calls(name: str, path: Path) -> list[Any]:
    family = FAMILIES[name]
    pipe = family.load(path)
    pipe.set_progress_bar_config(disable=True)
    return [pipe(**family.call(seed))[0] for seed in (0, 1)]


#: Each pipeline's plan before its first call, as auto says it: the diffusers adapter's
#: plan. ``model_cpu_offload_seq`` alone left out the ControlNet and Kandinsky's prior, and
#: gave AudioLDM2 none.
PLANS = {
    "sd-controlnet": "text_encoder -> unet+controlnet -> vae",
    "kandinsky2.2-combined": (
        "prior_text_encoder+prior_image_encoder -> prior_prior -> unet -> movq"
    ),
    "audioldm2": "text_encoder+text_encoder_2 -> unet -> vae+vocoder",
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_auto_gives_eagers_outputs_and_keeps_no_component_loaded(root: Path, name: str):
    """Reference: the same ``from_pretrained`` and calls without auto, this process, one
    thread."""
    path = folder(FAMILIES[name], root)
    want = two_calls(name, path)
    sink = ListSink()
    with auto(budget=1, events=sink):
        got = two_calls(name, path)
    assert same(got, want)
    said = [e.note for e in sink.events if e.kind == "note"]
    assert [n for n in said if not any(e in n for e in EXPECTED)] == []
    assert any(e.kind == "reload" for e in sink.events)
    # from_pretrained read nothing: each component was read at its first use
    first = {e.model: e.note for e in sink.events if e.kind == "load"}
    assert first and set(first.values()) == {"first use"}, first
    if name in PLANS:  # the diffusers adapter's plan, said before the first call
        plans = [n for n in said if "plan before" in n]
        assert plans == [f"the plan before the first use, from {_DIFFUSERS_PLAN}: {PLANS[name]}"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_with_room_to_load_ahead_auto_gives_eagers_outputs(root: Path, name: str):
    """A budget of 1.3 x the largest component: once diffusers' offload order is the plan,
    components load ahead in the background (some releasing others early: 14 of the 18
    families in one run; the count depends on measured times), and three seeded calls
    still give eager's outputs bit for bit (a draw on the load-ahead thread would move
    them: test_auto_ahead's control)."""
    path = folder(FAMILIES[name], root)
    family = FAMILIES[name]

    def three_calls(sized: bool) -> tuple[list[Any], dict[str, int]]:
        pipe = family.load(path)
        pipe.set_progress_bar_config(disable=True)
        sizes = {  # eager only: state_dict() under auto would load each component
            n: sum(t.numel() * t.element_size() for t in m.state_dict().values())
            for n, m in pipe.components.items()
            if sized and isinstance(m, torch.nn.Module)
        }
        # As served: each component's first use and its reloads inside inference_mode
        # (a reload there was taken for a change: position_ids, a buffer the files lack).
        with torch.inference_mode():
            return [pipe(**family.call(seed))[0] for seed in (0, 1, 2)], sizes

    want, sizes = three_calls(sized=True)
    sink = ListSink()
    with auto(budget=int(1.3 * max(sizes.values())), events=sink):
        got, _ = three_calls(sized=False)
    assert same(got, want)
    said = [e.note for e in sink.events if e.kind == "note"]
    assert [n for n in said if not any(e in n for e in EXPECTED)] == []


def test_control_with_the_offload_order_alone_the_controlnet_is_not_in_the_plan(
    root: Path, monkeypatch: pytest.MonkeyPatch
):
    """What the source was: ``model_cpu_offload_seq``, one component a stage."""
    import stageload.autostage as autostage

    def offload_order(pipe: Any) -> list[list[Any]]:
        return [[getattr(pipe, n.strip())] for n in pipe.model_cpu_offload_seq.split("->")]

    for spec, source in list(autostage.PLAN_SOURCES.items()):
        if spec.startswith("diffusers"):
            monkeypatch.setitem(
                autostage.PLAN_SOURCES, spec, autostage.PlanSource(offload_order, source.name)
            )
    path = folder(FAMILIES["sd-controlnet"], root)
    sink = ListSink()
    with auto(budget=1, events=sink):
        two_calls("sd-controlnet", path)
    plans = [e.note for e in sink.events if e.kind == "note" and "plan before" in e.note]
    assert plans == [
        f"the plan before the first use, from {_DIFFUSERS_PLAN}: text_encoder -> unet -> vae"
    ]


def round_trip(path: Path, staged: bool) -> tuple[list[Any], list[int]]:
    """Stable Diffusion: a call, ``pipe.to(float64)``, a call, ``pipe.to(float32)``, three
    calls (under a budget of 1 byte, each component reloads at each use); the outputs, and
    the unet's weights' addresses modulo 64 at the last three calls."""
    family, aligned = FAMILIES["sd"], []
    scope = auto(budget=1, events=ListSink(), prefetch=False) if staged else None
    with scope if scope is not None else contextlib.nullcontext():
        pipe = family.load(path)
        pipe.set_progress_bar_config(disable=True)
        outs = [pipe(**family.call(0))[0]]
        pipe.to(torch.float64)
        outs.append(pipe(**family.call(1))[0])
        pipe.to(torch.float32)
        hook = pipe.unet.register_forward_pre_hook(
            lambda m, a: aligned.extend(p.data_ptr() % 64 for p in m.parameters())
        )
        outs += [pipe(**family.call(seed))[0] for seed in (2, 3, 4)]  # and reloads after
        hook.remove()
    return outs, aligned


def test_a_dtype_round_trip_reloads_into_fresh_memory_as_the_scripts_conversion_did(root):
    """After ``float32 -> float64 -> float32`` (no value changed) the script's weights sit
    in fresh, 64-byte aligned memory; a reload from the files put them where the first
    load did (56 bytes past a line), and the unet's time embedding gave other last bits
    (a new-user helper's finding). Each reload now matches the script's placement."""
    path = folder(FAMILIES["sd"], root)
    want, want_aligned = round_trip(path, staged=False)
    got, got_aligned = round_trip(path, staged=True)
    assert got_aligned == want_aligned and set(want_aligned) == {0}
    assert same(got, want)


def test_control_reloaded_where_the_first_load_put_them_the_weights_are_not_aligned(
    root, monkeypatch
):
    import stageload.autostage as autostage

    real = autostage._layout

    def unmoved(*args: Any, **kwargs: Any) -> Any:
        return {n: (*want[:5], False) for n, want in real(*args, **kwargs).items()}

    monkeypatch.setattr(autostage, "_layout", unmoved)
    _, got_aligned = round_trip(folder(FAMILIES["sd"], root), staged=True)
    assert set(got_aligned) != {0}


def two_pipelines_from_two_threads(root: Path) -> tuple[list[str], bool]:
    """SD and SDXL made under auto on this thread, each then called once on a thread of its
    own, at once: their components' first loads (``from_pretrained``, deferred to the first
    use) run on the two threads. Returns the errors, and whether both outputs are eager's."""
    import threading

    families = [FAMILIES["sd"], FAMILIES["sdxl"]]
    paths = [folder(f, root) for f in families]
    want = []
    for family, path in zip(families, paths, strict=True):
        pipe = family.load(path)
        pipe.set_progress_bar_config(disable=True)
        want.append(pipe(**family.call(0))[0])
    got: dict[int, Any] = {}
    errors: list[str] = []
    with auto():
        pipes = [f.load(p) for f, p in zip(families, paths, strict=True)]

        def call(i: int) -> None:
            try:
                pipes[i].set_progress_bar_config(disable=True)
                got[i] = pipes[i](**families[i].call(0))[0]
            except Exception as exc:  # what the thread would have raised
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return errors, len(got) == 2 and all(same(got[i], want[i]) for i in range(2))


def test_two_pipelines_called_from_two_threads_load_one_at_a_time(root: Path):
    """``from_pretrained`` of transformers and diffusers sets process-wide state while it
    builds (accelerate's ``init_empty_weights`` patches ``nn.Module.register_parameter``);
    auto runs the deferred first loads one at a time. Two at once failed ("Unsupported
    device type 'meta'") in 4 of 4 runs of a new-user helper's script, and even a run that
    passed left the patch in place: every module made afterwards had its parameters on
    meta. Without auto, loading on one thread and calling on two works. Three runs here,
    each equal to eager, and a module made after them is a normal one."""
    for _ in range(3):
        assert two_pipelines_from_two_threads(root) == ([], True)
        assert not torch.nn.Linear(2, 2).weight.is_meta


def test_control_factories_run_at_once_fail(root: Path, monkeypatch: pytest.MonkeyPatch):
    """The check above can fail: without the lock, a run fails or leaves new modules on
    meta (the first run, here; up to 10 tries). What the races leave patched is put back
    after the test."""
    from stageload import external

    module = torch.nn.Module
    for name in ("register_parameter", "register_buffer"):
        monkeypatch.setattr(module, name, getattr(module, name))
    for name in dir(torch.nn.init):
        if not name.startswith("_") and callable(getattr(torch.nn.init, name)):
            monkeypatch.setattr(torch.nn.init, name, getattr(torch.nn.init, name))
    # transformers' own swaps too (conftest checks them after each test): a race leaves
    # an empty tie_weights now and then.
    from transformers import modeling_utils

    pretrained = modeling_utils.PreTrainedModel
    for name in ("tie_weights", "init_weights"):
        monkeypatch.setattr(pretrained, name, pretrained.__dict__[name])
    monkeypatch.setattr(external, "BUILD_LOCK", contextlib.nullcontext())
    broken = []
    for _ in range(10):
        errors, _ = two_pipelines_from_two_threads(root)
        broken = [*errors, *(["on meta"] if torch.nn.Linear(2, 2).weight.is_meta else [])]
        if broken:
            break
    assert broken


def img2img_plans(root: Path) -> tuple[list[Any], list[Any], Any]:
    """Stable Diffusion img2img (``vae.encode`` of the input image before the unet) under a
    budget for the unet beside the vae, two calls. Returns eager's outputs, auto's, and
    auto's plan after the first call."""
    family = FAMILIES["sd-img2img"]
    path = folder(family, root)
    want = two_calls("sd-img2img", path)
    with auto(budget=350_000, prefetch=False) as session:  # unet 268 kB + vae 61 kB
        pipe = family.load(path)
        pipe.set_progress_bar_config(disable=True)
        got = [pipe(**family.call(0))[0]]
        plan = session.record.plan
        got.append(pipe(**family.call(1))[0])
    return want, got, plan


def test_img2img_keeps_the_plan_it_started_with_its_vae_joining_the_first_stage(root: Path):
    """The offload order lists the vae last; img2img uses it first too. It joins the
    current stage, as the diffusers adapter's bridge, and the plan holds through the
    first call (dropped, the first two calls ran on least-recently-used alone)."""
    want, got, plan = img2img_plans(root)
    assert same(got, want)
    assert plan == {"text_encoder": ("text_encoder", "vae"), "unet": ("unet",), "vae": ("vae",)}


def test_control_a_use_before_its_stage_drops_the_plan(root: Path, monkeypatch: pytest.MonkeyPatch):
    import stageload.autostage as autostage

    monkeypatch.setattr(autostage._Record, "_later", lambda self, name: False)
    _, _, plan = img2img_plans(root)
    assert plan is None


# -- torch.autocast around the calls --------------------------------------------------------------
def calls_under_autocast(root: Path) -> tuple[bool, list[str], list[str]]:
    """Two seeded Stable Diffusion calls inside ``torch.autocast`` (bfloat16, the CPU's), as
    scripts write it, eager and under auto with a budget of 1 byte. Returns (the outputs
    equal eager's, what auto said, the models it released)."""
    path = folder(FAMILIES["sd"], root)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = two_calls("sd", path)
    sink = ListSink()
    with auto(budget=1, events=sink), torch.autocast("cpu", dtype=torch.bfloat16):
        got = two_calls("sd", path)
    said = [e.note for e in sink.events if e.kind == "note"]
    return same(got, want), said, [e.model for e in sink.events if e.kind == "release"]


def test_calls_under_autocast_release_each_model_as_without_it(root: Path):
    equal, said, released = calls_under_autocast(root)
    assert equal
    assert [n for n in said if not any(e in n for e in EXPECTED)] == []
    assert {"text_encoder", "unet", "vae"} <= set(released), released


def test_control_with_autocasts_cache_kept_every_model_stays_loaded(
    root: Path, monkeypatch: pytest.MonkeyPatch
):
    import stageload.autostage
    from stageload.hooks import release

    monkeypatch.setattr(stageload.autostage, "drop_autocast_casts", lambda: None)
    monkeypatch.setattr(release, "drop_autocast_casts", lambda: None)
    equal, said, released = calls_under_autocast(root)
    assert equal
    assert released == []
    assert [n for n in said if "held by an autograd graph" in n]
