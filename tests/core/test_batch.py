"""StagedModels.map: stage-major batches of real tiny models, compared with calls in turn.

Reference, unless a test says otherwise: ``in_turn``, the same calls one after the other on a
staged registry of ``load_block`` loaders (no ``map``), in this process; this process's
default torch threads on both sides."""

from __future__ import annotations

import pickle
import random
import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fixtures.tiny import load_block, save_block
from fixtures.traces import MIB
from stageload import BatchError, ListSink, StagedModels
from stageload.core import batch as batch_module
from stageload.report.trace import read_trace, stage_windows

STAGES = {"encode": ["encoder"], "denoise": ["denoiser"], "decode": ["decoder"]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {
        name: save_block(root / f"{name}.safetensors", seed=i)
        for i, name in enumerate(["encoder", "denoiser", "decoder"])
    }


def staged(checkpoints, counts=None, sink=None):
    def make(name):
        def load():
            if counts is not None:
                counts[name] = counts.get(name, 0) + 1
            return load_block(checkpoints[name])

        return load

    return StagedModels({n: make(n) for n in checkpoints}, stages=STAGES, events=sink)


@dataclass(frozen=True)
class Job:
    seed: int
    rows: int = 2
    again: bool = False  # go back to encode after denoise (a second, "negative" pass)
    fail_in: str | None = None
    hold: int = 0  # bytes of an extra tensor kept alive across the stages


def pipeline(models: StagedModels, job: Job) -> torch.Tensor:
    """A seeded 3-stage pipeline drawing from torch, random and NumPy's global generators."""
    torch.manual_seed(job.seed)
    random.seed(job.seed)
    np.random.seed(job.seed)
    kept = torch.ones(job.hold // 4)  # noqa: F841  (held to be seen by the estimate)
    x = torch.zeros(job.rows, 32)
    order = ["encode", "denoise", "encode", "decode"] if job.again else list(STAGES)
    for stage in order:
        models.enter(stage)
        if stage == job.fail_in:
            raise ValueError(f"job {job.seed} fails in {stage}")
        model = models[STAGES[stage][0]]
        noise = torch.randn(job.rows, 32) + random.random() + float(np.random.rand())
        x = model(x + noise)
    return x


def in_turn(checkpoints, jobs):
    models = staged(checkpoints)
    return [pipeline(models, job) for job in jobs]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_map_equals_calls_in_turn_and_loads_each_model_once(checkpoints, n):
    jobs = [Job(seed=10 + i, rows=1 + i % 3) for i in range(n)]
    expected = in_turn(checkpoints, jobs)
    counts: dict[str, int] = {}
    sink = ListSink()
    models = staged(checkpoints, counts, sink)
    out = models.map(lambda job: pipeline(models, job), jobs)
    assert len(out) == n
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
    assert counts == {"encoder": 1, "denoiser": 1, "decoder": 1}
    assert [e.stage for e in sink.kinds("stage")] == list(STAGES)
    assert not models.batch_running  # the hook is gone afterwards


def test_without_the_per_call_rng_swap_outputs_differ(checkpoints, monkeypatch):
    """Control: the equality above depends on restoring each call's RNG at every switch."""
    jobs = [Job(seed=10 + i) for i in range(3)]
    expected = in_turn(checkpoints, jobs)
    monkeypatch.setattr(batch_module, "restore_rng", lambda state: None)
    models = staged(checkpoints)
    out = models.map(lambda job: pipeline(models, job), jobs)
    # Call 0's first draw comes right after call 2 seeded the shared generator.
    assert not any(torch.equal(a, b) for a, b in zip(out, expected, strict=True))


def test_every_call_starts_from_the_rng_state_at_entry_and_ends_like_calls_in_turn(checkpoints):
    """Reference: the same ``draw`` run alone on the same registry from the same seed. Only
    random draws are compared, no arithmetic on them, so any thread count."""
    models = staged(checkpoints)

    def draw(_: int) -> torch.Tensor:  # does not seed itself
        models.enter("encode")
        first = torch.rand(3)
        models.enter("decode")
        return torch.cat([first, torch.rand(3)])

    torch.manual_seed(3)
    alone = draw(0)
    after_alone = torch.rand(1)
    torch.manual_seed(3)
    out = models.map(draw, range(4))
    assert all(torch.equal(o, alone) for o in out)
    assert torch.equal(torch.rand(1), after_alone)


def test_a_raising_call_does_not_stop_the_others(checkpoints):
    jobs = [Job(seed=1), Job(seed=2, fail_in="denoise"), Job(seed=3)]
    expected = in_turn(checkpoints, [jobs[0], jobs[2]])
    counts: dict[str, int] = {}
    models = staged(checkpoints, counts)
    with pytest.raises(BatchError, match=r"1 of 3 calls .*items \[1\].*job 2 fails") as info:
        models.map(lambda job: pipeline(models, job), jobs)
    err = info.value
    assert isinstance(err.__cause__, ValueError) and err.errors == {1: err.__cause__}
    assert torch.equal(err.results[0], expected[0]) and torch.equal(err.results[2], expected[1])
    assert counts == {"encoder": 1, "denoiser": 1, "decoder": 1}
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, BatchError) and set(again.errors) == {1}

    out = models.map(lambda job: pipeline(models, job), jobs, return_exceptions=True)
    assert isinstance(out[1], ValueError)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[2], expected[1])


@pytest.mark.parametrize("n", [2, 4])
def test_stage_reentry_enters_each_stage_as_often_as_one_call(checkpoints, n):
    """Calls going back to encode after denoise (and calls that don't, mixed in): the batch
    goes back once for all of them, not once per call, and the outputs are unchanged."""
    jobs = [Job(seed=i, again=i % 2 == 0) for i in range(n)]
    expected = in_turn(checkpoints, jobs)
    counts: dict[str, int] = {}
    sink = ListSink()
    models = staged(checkpoints, counts, sink)
    out = models.map(lambda job: pipeline(models, job), jobs)
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
    assert [e.stage for e in sink.kinds("stage")] == ["encode", "denoise", "encode", "decode"]
    assert counts == {"encoder": 2, "denoiser": 1, "decoder": 1}


def test_a_note_reports_the_intermediates_that_parked_calls_hold(checkpoints):
    sink = ListSink()
    models = staged(checkpoints, sink=sink)
    jobs = [Job(seed=i, hold=MIB) for i in range(4)]
    models.map(lambda job: pipeline(models, job), jobs)
    notes = [e for e in sink.kinds("note") if e.note and e.note.startswith("batch:")]
    assert [e.stage for e in notes] == list(STAGES)
    # Four 1 MiB tensors held in every call's frame, plus small activations.
    assert all(4 * MIB <= e.bytes < 4 * MIB + 64 * 1024 for e in notes), [e.bytes for e in notes]
    assert "items [0, 1, 2, 3]" in notes[0].note


@pytest.mark.parametrize("listens", [False, True], ids=["no sink", "control-a sink"])
def test_the_held_bytes_walk_is_made_only_for_a_sink(checkpoints, monkeypatch, listens):
    """The note walks every object gc tracks (about 0.1 s a stage with diffusers imported):
    with no sink to read it, the batch makes no walk and runs the same."""
    walks = []
    walk = batch_module._live_storage_sizes
    monkeypatch.setattr(batch_module, "_live_storage_sizes", lambda: walks.append(1) or walk())
    jobs = [Job(seed=i) for i in range(2)]
    expected = in_turn(checkpoints, jobs)
    models = staged(checkpoints, sink=ListSink() if listens else None)
    out = models.map(lambda job: pipeline(models, job), jobs)
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
    # One walk before the calls run, one at each stage entered.
    assert len(walks) == (1 + len(STAGES) if listens else 0)


def test_map_under_memory_meter_gives_one_window_per_stage(checkpoints, tmp_path):
    from stageload import MemoryMeter

    path = tmp_path / "batch.jsonl"
    with MemoryMeter(path, 0.02, sampler="thread") as meter:
        models = staged(checkpoints, sink=meter)
        models.map(lambda job: pipeline(models, job), [Job(seed=i) for i in range(3)])
    trace = read_trace(path)
    windows = stage_windows(trace)
    assert [w.stage for w in windows] == ["setup", *STAGES]
    loads = [e for e in trace.events if e.kind == "load"]
    assert [e.model for e in loads] == ["encoder", "denoiser", "decoder"]
    for event in loads:  # each model loads inside the window of the stage that lists it
        window = next(w for w in reversed(windows) if w.start <= event.t)
        assert window.stage == event.stage and event.model in STAGES[window.stage]


def test_calls_inherit_grad_mode_and_context_of_the_caller(checkpoints):
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    models = staged(checkpoints)

    def probe(_: int) -> tuple[bool, str, bool]:
        models.enter("encode")
        return torch.is_grad_enabled(), var.get(), threading.current_thread().daemon

    var.set("caller")
    with torch.no_grad():
        out = models.map(probe, range(2))
    assert out == [(False, "caller", True)] * 2


def test_bad_use_fails_clearly(checkpoints):
    models = staged(checkpoints)
    with pytest.raises(TypeError, match="function to run first"):
        models.map([1, 2], len)  # type: ignore[arg-type]
    assert models.map(len, []) == []

    def nested(_: int) -> list[int]:
        return models.map(len, [[1]])

    with pytest.raises(BatchError) as info:
        models.map(nested, [0])
    assert "a call of a batch cannot start another" in str(info.value.errors[0])


def test_a_second_thread_s_map_is_told_one_batch_at_a_time(checkpoints):
    """Found by a new-user helper: it was told it was a call of the batch, which it is not."""
    import threading

    models = staged(checkpoints)
    inside, go = threading.Event(), threading.Event()

    def held(_: int) -> None:
        inside.set()
        go.wait(60)

    first = threading.Thread(target=models.map, args=(held, [0]))
    first.start()
    assert inside.wait(60)
    try:
        with pytest.raises(RuntimeError, match="already running a batch on these models; one "):
            models.map(len, [[1]])
    finally:
        go.set()
        first.join()
    assert models.map(len, [[1]]) == [1]


@pytest.mark.parametrize("fit", [2, 3])
def test_map_under_a_budget_with_prefetch_loads_each_model_once(checkpoints, fit):
    """With the residency policy of a budget (two or all three models fit) and prefetch
    (rng-free loaders, loading the next stage's model while the calls compute)."""
    from safetensors.torch import load_file

    from fixtures.tiny import Block
    from stageload import rng_free

    def loader(name):
        @rng_free
        def load() -> Block:
            counts[name] = counts.get(name, 0) + 1
            with torch.device("meta"):
                model = Block()
            model.load_state_dict(load_file(str(checkpoints[name])), assign=True)
            return model

        return load

    size = sum(t.numel() * 4 for t in Block().state_dict().values())

    def batch(n: int) -> tuple[dict[str, int], ListSink]:
        counts.clear()
        sink = ListSink()
        models = StagedModels(
            {name: loader(name) for name in checkpoints},
            stages=STAGES,
            events=sink,
            budget=fit * size,
            prefetch=True,
            sizes=dict.fromkeys(checkpoints, size),
        )
        jobs = [Job(seed=i, rows=1 + i) for i in range(n)]
        out = models.map(lambda job: pipeline(models, job), jobs)
        expected = in_turn(checkpoints, jobs)
        assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
        models.close()
        return dict(counts), sink

    counts: dict[str, int] = {}
    one, _ = batch(1)
    four, sink = batch(4)
    assert four == one  # independent of N
    assert sink.kinds("prefetch"), "the next stage's model was loaded ahead"
    # With room for two, entering decode could prefetch the encoder for a next call (the
    # policy takes the plan to repeat) by releasing the denoiser early; the prefetch cost
    # model skips it (decode's compute is not measured yet), so no load is wasted on a next
    # call that a batch never makes.
    assert four == dict.fromkeys(checkpoints, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (not run here)")
def test_the_cuda_generator_is_swapped_per_call_too(checkpoints):
    """Reference: the same ``draw`` calls run alone on the same registry. Only random draws
    are compared, no arithmetic on them, so any thread count."""
    models = staged(checkpoints)

    def draw(seed: int) -> torch.Tensor:
        torch.cuda.manual_seed(seed)
        models.enter("encode")
        first = torch.randn(4, device="cuda")
        models.enter("decode")
        return torch.cat([first, torch.randn(4, device="cuda")]).cpu()

    alone = [draw(s) for s in range(3)]
    out = models.map(draw, range(3))
    assert all(torch.equal(a, b) for a, b in zip(out, alone, strict=True))


def interrupted_on_denoise(checkpoints) -> StagedModels:
    """Models whose policy raises KeyboardInterrupt on entering denoise: a Ctrl-C in the
    batch's scheduler."""
    from stageload import ReleaseUnlisted

    class Interrupting(ReleaseUnlisted):
        def to_release(self, stage, loaded, plan):
            if stage == "denoise":
                raise KeyboardInterrupt
            return super().to_release(stage, loaded, plan)

    return StagedModels(
        {n: (lambda p=p: load_block(p)) for n, p in checkpoints.items()},
        stages=STAGES,
        policy=Interrupting(),
    )


def test_an_interrupted_batch_unwinds_every_parked_call(checkpoints):
    """Ctrl-C in the scheduler (here: raised by the policy on entering denoise): map()
    re-raises it after each parked call has run its finally blocks, even one that tries to
    change stage while unwinding; no call thread is left behind."""
    models = interrupted_on_denoise(checkpoints)
    unwound = []

    def fn(i: int) -> None:
        try:
            models.enter("encode")
            models.enter("denoise")
        finally:
            unwound.append(i)
            models.enter("decode")  # parks no more: raises again, inside the finally

    before = threading.active_count()
    with pytest.raises(KeyboardInterrupt):
        models.map(fn, range(3))
    assert sorted(unwound) == [0, 1, 2]
    assert threading.active_count() == before
    assert not models.batch_running


@pytest.mark.parametrize("control", [False, True], ids=["dropped", "control-kept"])
def test_an_interrupts_traceback_keeps_no_items_tensors(checkpoints, monkeypatch, control):
    """After a Ctrl-C in the scheduler, the KeyboardInterrupt's traceback (kept by Jupyter
    as ``sys.last_traceback``) holds the batch; the calls it unwound held their items'
    tensors through their errors' frames. None stays alive while the traceback does.
    Control: an abandon that keeps the calls' errors keeps every item's tensor."""
    import gc
    import weakref

    if control:
        monkeypatch.setattr(batch_module.Batch, "_drop", staticmethod(lambda call: None))

    models = interrupted_on_denoise(checkpoints)
    held = []

    def fn(i: int) -> None:
        models.enter("encode")
        activations = torch.ones(1 << 18)  # 1 MiB each call holds across its park
        held.append(weakref.ref(activations))
        models.enter("denoise")

    with pytest.raises(KeyboardInterrupt) as info:
        models.map(fn, range(3))
    gc.collect()
    alive = [r for r in held if r() is not None]
    assert info.value.__traceback__ is not None  # kept, as Jupyter keeps it
    assert len(held) == 3
    assert len(alive) == (3 if control else 0), f"{len(alive)} of 3 items' tensors alive"
