"""Residency under a memory budget: furthest-next-use eviction against the brute-force
optimum, budgets, real peak footprint, prefetch (bit for bit, the RNG rule and its
control), races, and the events that say why."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import stageload.hooks.release as release_module
from fixtures.tiny import Block, load_block, save_block
from stageload import ListSink, ModelLoadError, StagedModels, from_safetensors
from stageload.core.policy import FurthestNextUse, PolicyView
from stageload.load.loaders import is_rng_free, rng_free
from stageload.memory import read_process, read_system
from stageload.memory.budget import AUTO_RESERVE_MIN, parse_budget

KIB = 1024


class Sized(nn.Module):
    """A model of exactly ``units`` KiB of weights, built without drawing random numbers."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.register_buffer("w", torch.zeros(units * KIB // 4))


@pytest.fixture(autouse=True)
def no_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests drive StagedModels through thousands of stage changes with KiB models to
    count loads and victims. The one gc.collect() each enter() now runs (0.1-0.5 s in a
    torch process here: bench/results/release_gc) would make them minutes long and change
    no count; tests/hooks/test_release_gc.py checks the collection itself."""
    monkeypatch.setattr(release_module, "collect_garbage", lambda: None)


def sized_loaders(sizes: dict[str, int], counts: dict[str, int]) -> dict:
    def make(name):
        def load():
            counts[name] = counts.get(name, 0) + 1
            return Sized(sizes[name])

        return load

    return {name: make(name) for name in sizes}


def run_calls(models: StagedModels, n: int) -> None:
    for _ in range(n):
        for stage, names in models.stages.items():
            models.enter(stage)
            for name in names:
                models[name]


def optimum(stages: dict, sizes: dict, budget: int, n: int) -> int:
    """Fewest loads for ``n`` calls: every choice of what to keep at every stage (a DP over
    resident sets, which is exhaustive: a state is all that matters for the future)."""
    best = {frozenset(): 0}
    for need in [tuple(v) for v in stages.values()] * n:
        nxt: dict[frozenset, int] = {}
        for state, cost in best.items():
            extra = [m for m in state if m not in need]
            cost += sum(1 for m in need if m not in state)
            for r in range(len(extra) + 1):
                for keep in itertools.combinations(extra, r):
                    s = frozenset((*need, *keep))
                    if sum(sizes[m] for m in s) <= budget and nxt.get(s, 1 << 30) > cost:
                        nxt[s] = cost
        best = nxt
    return min(best.values())


def budget_loads(stages: dict, sizes: dict, budget_units: int, n: int) -> int:
    counts: dict[str, int] = {}
    models = StagedModels(
        sized_loaders(sizes, counts),
        stages=stages,
        budget=budget_units * KIB,
        sizes={k: v * KIB for k, v in sizes.items()},
    )
    run_calls(models, n)
    return sum(counts.values())


def random_plans(seed: int, count: int, equal: bool):
    rng = random.Random(seed)
    for _ in range(count):
        models = "abcde"[: rng.randint(3, 5)]
        stages = {
            f"s{i}": tuple(rng.sample(models, rng.randint(1, 2))) for i in range(rng.randint(2, 5))
        }
        sizes = {m: 1 if equal else rng.choice([1, 2, 3, 5]) for m in models}
        yield stages, sizes


def budgets(stages: dict, sizes: dict) -> range:
    used = {m for names in stages.values() for m in names}
    lowest = max(sum(sizes[m] for m in names) for names in stages.values())
    return range(lowest, sum(sizes[m] for m in used) + 1)


# Plans shaped like real pipelines; sizes in units (roughly GiB), unequal.
PIPELINES = {
    "qwen-image": (
        {"encode": ("te",), "denoise": ("tr",), "decode": ("vae",)},
        {"te": 16, "tr": 13, "vae": 1},
    ),
    "img2img": (
        {"encode": ("te", "vae"), "denoise": ("unet",), "decode": ("vae",)},
        {"te": 5, "vae": 1, "unet": 10},
    ),
    "sdxl-refiner": (
        {"encode": ("te", "te2"), "base": ("unet",), "refine": ("te2", "ref"), "decode": ("vae",)},
        {"te": 1, "te2": 7, "unet": 13, "ref": 11, "vae": 1},
    ),
    "wan2.2": (
        {"encode": ("te",), "high": ("hi",), "low": ("lo",), "decode": ("vae",)},
        {"te": 11, "hi": 14, "lo": 14, "vae": 1},
    ),
    "pixal3d": (
        {
            "preprocess": ("rembg",),
            "structure": ("dino", "ss"),
            "shape": ("dino", "naf", "shape"),
            "texture": ("dino", "tex"),
            "decode": ("dec",),
        },
        {"rembg": 1, "dino": 3, "ss": 2, "naf": 1, "shape": 5, "tex": 5, "dec": 2},
    ),
}


def test_equal_sizes_load_count_is_the_offline_optimum():
    """Belady's rule is optimal for equal sizes; here on 40 random cyclic plans, every
    budget from the largest stage to everything, for 1 and 3 calls."""
    cases = 0
    for stages, sizes in random_plans(seed=1, count=40, equal=True):
        for budget in budgets(stages, sizes):
            for n in (1, 3):
                assert budget_loads(stages, sizes, budget, n) == optimum(
                    stages, sizes, budget, n
                ), (stages, budget, n)
                cases += 1
    assert cases > 150


def test_unequal_sizes_on_pipeline_plans_load_count_is_the_offline_optimum_but_for_two():
    """Every budget from the largest stage to everything, 1 and 4 calls. With unequal
    sizes no greedy rule is always optimal (the problem is NP-hard); ours misses the
    optimum by one load in two of the 152 cases below, both on the Pixal3D-shaped plan.
    docs/residency.md states this; the test pins it, so a change either way shows."""
    missed = []
    for name, (stages, sizes) in PIPELINES.items():
        for budget in budgets(stages, sizes):
            for n in (1, 4):
                got = budget_loads(stages, sizes, budget, n)
                best = optimum(stages, sizes, budget, n)
                assert got >= best
                if got != best:
                    missed.append((name, budget, n, got, best))
    assert missed == [("pixal3d", 13, 4, 16, 15), ("pixal3d", 16, 4, 13, 12)]
    # Control: today's release-unlisted staging loads every stage's models every call.
    stages, sizes = PIPELINES["qwen-image"]
    counts: dict[str, int] = {}
    run_calls(StagedModels(sized_loaders(sizes, counts), stages=stages), 4)
    assert sum(counts.values()) == 12 > optimum(stages, sizes, 17, 4)


def test_a_budget_that_holds_everything_loads_each_model_once_over_n_calls():
    stages, sizes = PIPELINES["sdxl-refiner"]
    counts: dict[str, int] = {}
    sink = ListSink()
    models = StagedModels(
        sized_loaders(sizes, counts), stages=stages, budget="1G", events=sink
    )  # sizes learned at first load
    run_calls(models, 5)
    assert counts == dict.fromkeys(sizes, 1)
    assert sink.kinds("release") == []
    # Control: today's staging reloads what the next stage does not list, every call.
    counts.clear()
    run_calls(StagedModels(sized_loaders(sizes, counts), stages=stages), 5)
    assert sum(counts.values()) > 5 * len(sizes) - 1


def test_eviction_order_and_reasons():
    """Unplanned models first, then furthest next use (cyclic), ties: smaller first."""
    stages = {"a": ("A",), "b": ("B",), "c": ("C",), "d": ("D",)}
    sizes = {"A": 2, "B": 2, "C": 1, "D": 4, "X": 1}
    plan = PolicyView(stages=stages, pinned=frozenset(), sizes=sizes)
    policy = FurthestNextUse(6)
    # In stage d: A is next used 1 stage on, B 2, C 3, X never.
    # Need 4 more: X, then the fewest planned models that free the rest, furthest first.
    assert policy.victims("d", ["A", "B", "C", "X"], plan) == ["X", "C", "B"]
    assert policy.victims("d", ["A", "B", "X"], plan) == ["X", "B"]
    # A far small model taken before a near large one that alone frees enough is kept.
    assert FurthestNextUse(5).victims("d", ["A", "C"], plan) == ["A"]
    assert policy.why("X", "d", plan) == "not in plan" and policy.why("A", "d", plan) == "budget"

    sink = ListSink()
    loaders = {name: (lambda n=n: Sized(n)) for name, n in sizes.items()}
    models = StagedModels(loaders, stages=stages, budget=6 * KIB, events=sink, sizes={"D": 4 * KIB})
    models.enter("a")
    models["A"], models["X"]
    models.enter("b")
    models["B"]
    models.enter("d")  # needs 4: X (unplanned) goes, then B (next use furthest)
    models["D"]
    models.evict("D")
    models.close()
    reasons = [(e.model, e.reason) for e in sink.kinds("release")]
    assert reasons == [("X", "not in plan"), ("B", "budget"), ("D", "evict"), ("A", "close")]
    # Today's policy says why too.
    sink2 = ListSink()
    plain = StagedModels(loaders, stages=stages, events=sink2)
    plain.enter("a"), plain["A"], plain.enter("b")
    assert [e.reason for e in sink2.kinds("release")] == ["not in plan"]


def test_a_stage_over_budget_runs_and_a_note_says_by_how_much():
    sink = ListSink()
    stages = {"small": ("a",), "big": ("a", "b")}
    loaders = {"a": lambda: Sized(4), "b": lambda: Sized(8)}
    models = StagedModels(
        loaders, stages=stages, budget=10 * KIB, events=sink, sizes={"a": 4 * KIB, "b": 8 * KIB}
    )
    models.enter("small")
    models["a"]
    assert sink.kinds("note") == []
    models.enter("big")
    models["a"], models["b"]
    notes = sink.kinds("note")
    assert len(notes) == 1 and notes[0].bytes == 2 * KIB and "by 2.0 KiB" in notes[0].note
    # Without sizes=, the note comes after the load that measured the excess.
    sink.events.clear()
    models = StagedModels(loaders, stages=stages, budget=10 * KIB, events=sink)
    models.enter("big")
    models["a"], models["b"]
    assert [n.bytes for n in sink.kinds("note")] == [2 * KIB]


def test_peak_footprint_stays_within_budget_plus_working_memory():
    """Real anonymous memory (RssAnon, not mmapped files), sampled every 2 ms."""
    mib = 1 << 20
    stages = {"encode": ("te",), "denoise": ("tr",), "decode": ("vae",)}
    sizes = {"te": 40 * mib, "tr": 48 * mib, "vae": 16 * mib}

    def loaders():
        return {n: (lambda s=s: _filled(s)) for n, s in sizes.items()}

    def peak_over_baseline(**kwargs) -> int:
        models = StagedModels(loaders(), stages=stages, **kwargs)
        stop, peak = threading.Event(), [0]
        base = read_process().footprint

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], read_process().footprint)
                time.sleep(0.002)

        thread = threading.Thread(target=sample)
        thread.start()
        try:
            for _ in range(2):
                for stage, names in stages.items():
                    models.enter(stage)
                    for name in names:
                        models[name]
                    peak[0] = max(peak[0], read_process().footprint)
        finally:
            stop.set()
            thread.join()
            models.close()
        return peak[0] - base

    budget = 64 * mib  # fits tr + vae or te + vae, never te + tr
    working = 12 * mib  # the samplers, allocator slack, the interpreter
    assert peak_over_baseline(budget=budget, sizes=sizes) <= budget + working
    # Control: keeping everything (a budget that holds it all) goes past it.
    assert peak_over_baseline(budget="1G") > budget + working


def _filled(nbytes: int) -> nn.Module:
    module = nn.Module()
    module.register_buffer("w", torch.ones(nbytes // 4))  # touched: really resident
    return module


# -- prefetch ------------------------------------------------------------------------------

STAGES = {"encode": ["encoder"], "denoise": ["denoiser"], "decode": ["decoder"]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blocks")
    names = [name for (name,) in STAGES.values()]
    return {n: save_block(folder / f"{n}.safetensors", seed=i) for i, n in enumerate(names)}


def block_rng_free(path):
    """Build on meta (no random init) and assign the file's tensors: draws nothing."""

    @rng_free
    def load() -> Block:
        with torch.device("meta"):
            model = Block()
        model.load_state_dict(load_file(str(path)), assign=True)
        return model

    return load


def pipeline(get, enter=lambda stage: None, calls: int = 2) -> list[torch.Tensor]:
    """A seeded 3-stage pipeline, called ``calls`` times; noise drawn in every stage."""
    torch.manual_seed(11)
    outs = []
    for _ in range(calls):
        x = torch.zeros(2, 32)
        for stage, (name,) in STAGES.items():
            enter(stage)
            x = get(name)(x + torch.randn(2, 32))
            torch.randn(64)  # more draws in the stage, while a prefetch may be running
        outs.append(x)
    return outs


def eager_outputs(checkpoints):
    models = {n: load_block(p) for n, p in checkpoints.items()}
    return pipeline(models.__getitem__)


def staged_run(loaders, **kwargs):
    sink = ListSink()
    models = StagedModels(loaders, stages=STAGES, events=sink, **kwargs)
    out = pipeline(models.__getitem__, models.enter)
    models.close()
    return out, sink


def test_prefetch_is_bit_identical_to_eager_with_rng_free_loaders(checkpoints):
    """Reference: eager, ``eager_outputs``: every model loaded up front by ``load_block`` (a
    Block built, then ``load_state_dict(load_file(...))``), in this process; this process's
    default torch threads on both sides."""
    eager = eager_outputs(checkpoints)
    loaders = {n: block_rng_free(p) for n, p in checkpoints.items()}
    assert all(is_rng_free(f) for f in loaders.values())
    size = sum(t.numel() * 4 for t in Block().state_dict().values())
    # Two of the three fit: the next stage's model loads while the current one computes.
    sizes = dict.fromkeys(loaders, size)
    # The cost model off: every prefetch that fits is made (these stages compute too
    # briefly to hide a load, so the cost model would skip most of them).
    policy = FurthestNextUse(2 * size, prefetch=True, cost_model=False)
    out, sink = staged_run(loaders, policy=policy, prefetch=True, sizes=sizes)
    prefetched = sink.kinds("prefetch")
    assert len(prefetched) >= 3, sink.events  # the check below is not vacuous
    assert all(e.note and e.note.startswith("for stage") for e in prefetched)
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))
    # The cost model on (the default): whatever it decides, the outputs are the same.
    out, sink = staged_run(loaders, budget=2 * size, prefetch=True, sizes=sizes)
    assert sink.kinds("prefetch"), sink.events
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))


def test_a_random_drawing_loader_is_not_prefetched_unless_opted_in(checkpoints):
    """The rule's reason, and its control: a loader that runs random initialisers (as
    load_block does) changes the main thread's stream when it runs in the background.
    Reference: eager, ``eager_outputs`` (``load_block`` up front), in this process; this
    process's default torch threads on both sides."""
    eager = eager_outputs(checkpoints)
    loaders = {n: (lambda p=p: load_block(p)) for n, p in checkpoints.items()}
    size = sum(t.numel() * 4 for t in Block().state_dict().values())
    sizes = dict.fromkeys(loaders, size)
    out, sink = staged_run(loaders, budget=2 * size, prefetch=True, sizes=sizes)
    assert sink.kinds("prefetch") == []  # unmarked: loaded on demand, under preserved_rng
    assert "'decoder', 'denoiser', 'encoder' will load on demand" in sink.events[0].note
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))
    # Control: opted in by name although it draws random numbers -> the outputs change.
    # (The cost model off: every prefetch that fits is made, these stages being too short
    # to hide a load.)
    uncosted = FurthestNextUse(2 * size, prefetch=True, cost_model=False)
    out, sink = staged_run(loaders, policy=uncosted, prefetch=list(checkpoints), sizes=sizes)
    assert len(sink.kinds("prefetch")) >= 3
    assert not all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))


def test_a_loader_not_ready_for_background_is_loaded_on_demand(checkpoints):
    """``background_ready()`` is asked at every decision: the diffusers adapter's first
    load (from_pretrained) is unsafe beside a running call, its later refills are not.
    Reference: eager, ``eager_outputs`` (``load_block`` up front), in this process; this
    process's default torch threads on both sides."""
    eager = eager_outputs(checkpoints)
    ready = {"flag": False}
    loaders = {n: block_rng_free(p) for n, p in checkpoints.items()}
    for f in loaders.values():
        f.background_ready = lambda: ready["flag"]
    size = sum(t.numel() * 4 for t in Block().state_dict().values())
    sizes = dict.fromkeys(loaders, size)
    out, sink = staged_run(loaders, budget=2 * size, prefetch=True, sizes=sizes)
    assert sink.kinds("prefetch") == []
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))
    ready["flag"] = True  # control: the same loaders, now ready, are prefetched
    uncosted = FurthestNextUse(2 * size, prefetch=True, cost_model=False)
    out, sink = staged_run(loaders, policy=uncosted, prefetch=True, sizes=sizes)
    assert len(sink.kinds("prefetch")) >= 3


def test_a_model_being_prefetched_is_waited_for_not_loaded_twice():
    gate, started = threading.Event(), threading.Event()
    counts: dict[str, int] = {}

    @rng_free
    def slow():
        counts["b"] = counts.get("b", 0) + 1
        started.set()
        assert gate.wait(20), "the test never opened the gate"
        return Sized(4)

    @rng_free
    def quick():
        counts["c"] = counts.get("c", 0) + 1
        return Sized(1)

    stages = {"one": ("a",), "two": ("b",), "three": ("c",)}
    models = StagedModels(
        {"a": rng_free(lambda: Sized(1)), "b": slow, "c": quick},
        stages=stages,
        budget=64 * KIB,
        prefetch=True,
        sizes={"a": KIB, "b": 4 * KIB, "c": KIB},
    )
    models.enter("one")
    assert started.wait(20)  # b is loading in the background now
    # The registry's lock is not held by the running loader: other loads go on.
    assert models["a"] is models["a"] and models["c"] is not None
    got: list[nn.Module] = []
    waiters = [threading.Thread(target=lambda: got.append(models["b"])) for _ in range(3)]
    for t in waiters:
        t.start()
    time.sleep(0.05)
    gate.set()
    for t in waiters:
        t.join(20)
    assert len(got) == 3 and all(m is got[0] for m in got)
    assert counts == {"b": 1, "c": 1}


def test_concurrent_first_uses_load_once():
    counts: dict[str, int] = {}

    def slow():
        counts["m"] = counts.get("m", 0) + 1
        time.sleep(0.2)
        return Sized(1)

    models = StagedModels({"m": slow}, stages={"s": ["m"]})
    barrier = threading.Barrier(4)
    got: list[nn.Module] = []

    def use():
        barrier.wait()
        got.append(models["m"])

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert counts == {"m": 1} and len(got) == 4 and all(m is got[0] for m in got)


def test_a_failed_prefetch_raises_model_load_error_at_first_use_then_retries():
    calls = {"n": 0}

    @rng_free
    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise FileNotFoundError("b.safetensors")
        return Sized(1)

    sink = ListSink()
    models = StagedModels(
        {"a": rng_free(lambda: Sized(1)), "b": flaky},
        stages={"one": ("a",), "two": ("b",)},
        budget=8 * KIB,
        prefetch=True,
        sizes={"a": KIB, "b": KIB},
        events=sink,
    )
    models.enter("one")
    models["a"]
    models.enter("two")  # waits for the failed prefetch without raising
    assert any("prefetch of 'b' failed" in (e.note or "") for e in sink.kinds("note"))
    with pytest.raises(ModelLoadError, match="'b' for stage 'two'") as info:
        models["b"]
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert models["b"] is not None and calls["n"] == 2


# -- configuration -------------------------------------------------------------------------
@pytest.mark.alone  # reads the machine's available memory
def test_budget_parsing():
    assert parse_budget(1000) == 1000
    assert parse_budget("12G") == 12 << 30
    system = read_system()
    assert parse_budget("50%") == int(system.total * 0.5)
    auto = parse_budget("auto")
    reserve = max(AUTO_RESERVE_MIN, int(system.total * 0.10))
    assert abs(auto - (system.available - reserve)) < 256 << 20  # available moves a little
    for bad, match in [
        ("lots", "invalid budget 'lots'"),
        (0, "invalid budget 0: it must be more than 0 bytes"),
        ("150%", "more than 0% and at most 100%"),
        (True, "budget must be bytes"),
        (-1, "invalid budget -1"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            parse_budget(bad)


def test_construction_errors_name_the_fix():
    load = {"a": lambda: Sized(1)}
    with pytest.raises(ValueError, match="prefetch needs a budget.*budget='auto'"):
        StagedModels(load, stages={"s": ["a"]}, prefetch=True)
    with pytest.raises(ValueError, match="budget= or policy=, not both"):
        StagedModels(load, stages={"s": ["a"]}, budget="1G", policy=FurthestNextUse(1))
    with pytest.raises(ValueError, match="prefetch names 'z'"):
        StagedModels(load, stages={"s": ["a"]}, budget="1G", prefetch=["z"])
    with pytest.raises(ValueError, match="sizes names 'z'"):
        StagedModels(load, stages={"s": ["a"]}, sizes={"z": 1})


@pytest.mark.parametrize(
    ("size", "said"),
    [(-1, "must not be negative, got -1"), ("big", "invalid size 'big'"), (1.5j, "")],
)
def test_a_wrong_size_names_its_model(size, said):
    # A new user's sizes={"a": "big"} was told "invalid size 'big'" with no model named:
    # with several models, which one was unsaid.
    load = {"a": lambda: Sized(1), "b": lambda: Sized(1)}
    with pytest.raises((ValueError, TypeError)) as err:
        StagedModels(load, stages={"s": ["a", "b"]}, sizes={"a": "1G", "b": size})
    assert str(err.value).startswith("sizes['b']: "), err.value
    assert said in str(err.value)


def test_rng_free_marks_functions_and_wraps_what_takes_no_attributes():
    def f():
        return Sized(1)

    assert rng_free(f) is f and f.draws_random is False and is_rng_free(f)
    bound = Sized(1).cpu  # a bound method takes no attributes
    wrapped = rng_free(bound)
    assert is_rng_free(wrapped) and not is_rng_free(bound)
    assert not is_rng_free(lambda: None)
    # The fast loader marks its loaders: they build on meta and only read.
    assert is_rng_free(from_safetensors(lambda: Block(), "unused.safetensors"))


def test_the_report_counts_prefetches_and_keeps_stage_windows(tmp_path):
    """A trace with prefetch events and release reasons: stage windows as before, and a
    prefetches row only where a run had them."""
    from fixtures.traces import staged_records, write_trace
    from stageload.report.tables import format_report
    from stageload.report.trace import read_trace, summarize

    records = staged_records()
    plain = summarize(read_trace(write_trace(tmp_path / "plain.jsonl", records)))
    at = next(i for i, r in enumerate(records) if r.get("kind") == "release")
    records[at] = {**records[at], "reason": "budget"}
    extra = {"type": "event", "t": 1.0, "kind": "prefetch", "model": "denoiser"}
    records.insert(at - 1, {**extra, "stage": "encode", "bytes": 7, "seconds": 0.5})
    with_prefetch = summarize(read_trace(write_trace(tmp_path / "p.jsonl", records)))
    assert [w.start for w in with_prefetch.windows] == [w.start for w in plain.windows]
    assert (with_prefetch.prefetches.count, with_prefetch.prefetches.bytes) == (1, 7)
    assert with_prefetch.loads.count == plain.loads.count
    assert "prefetches" in format_report([with_prefetch])
    assert "prefetches" not in format_report([plain])
