"""stageload.ray on a real local Ray bound to 127.0.0.1.

One cluster for the module (starting Ray is the slow part), one probed run_batch shared by
the checks that only read it; a run_batch worker and a map_batches actor each killed
mid-batch, each with a max_restarts=0 control; StagedPredictor, rows_to_calls and
worker_threads without Ray.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from functools import partial

import pytest

# Read by Ray when it is imported: "127.0.0.1" stays the loopback address instead of being
# rewritten to the machine's outward IP, so everything Ray starts here listens on loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from stageload.ray import call_kwargs, report, stream_batch, worker_threads  # noqa: E402
from stageload.ray._stream import fitting_workers  # noqa: E402
from stageload.report.records import read_trace  # noqa: E402
from stageload.report.trace import load_summary  # noqa: E402
from stageload.testing.ray import STAGES, make_toy  # noqa: E402

LOOPBACK = "127.0.0.1"
HEAD_MEMORY = 4 << 30
# Less than any Python process with torch imported holds.
SMALL_MEMORY = 64 << 20
WIDTH = 256
MAKE = partial(make_toy, WIDTH)
# The probe runs the first; the other four make two chunks of two, one per worker.
CALLS = [{"prompt": i, "seed": 100 + i, "steps": 2} for i in range(5)]


@pytest.fixture(scope="module")
def cluster():
    # Before any Ray process starts: patience for a busy machine (the raylet waits for
    # its agents' port files; 2 CPUs shared with other work).
    env = {
        "RAY_raylet_start_wait_time_s": "300",
        "RAY_agent_register_timeout_ms": "300000",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ray.init(
            address="local",  # a new Ray, never one another process left running
            num_cpus=2,
            _memory=HEAD_MEMORY,
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            log_to_driver=False,
        )
        # Everything the test started talks over loopback only.
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert [n["NodeManagerAddress"] for n in nodes] == [LOOPBACK]
        yield {"head": nodes[0]["NodeID"]}
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def local_results(calls, threads_of_cpus=1):
    """The calls run here one by one, with the torch threads of a 1-CPU Ray worker."""
    pipe = MAKE()
    with worker_threads(threads_of_cpus):
        return [pipe(**call_kwargs(c)) for c in calls]


@pytest.fixture(scope="module")
def batch(cluster, tmp_path_factory):
    traces = tmp_path_factory.mktemp("ray-traces")
    stream = stream_batch(MAKE, CALLS, trace_dir=traces)
    seen = []
    used = expected = None
    for index, result in stream:
        seen.append((index, result))
        if used is None and stream.workers:
            expected = len(stream.workers) * stream.peak
            used = _memory_in_use(expected)
    return {"stream": stream, "seen": seen, "traces": traces, "used": (used, expected)}


def _memory_in_use(expected, wait=300.0):
    """The cluster's memory resource in use, polled until it shows ``expected`` (Ray
    reports resources with a delay); the last reading otherwise. The limit is generous: a
    right reading ends the wait, and a busy machine delays the report."""
    deadline = time.monotonic() + wait
    while True:
        total = ray.cluster_resources().get("memory", 0)
        free = ray.available_resources().get("memory", 0)
        used = int(total - free)
        if used == expected or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def test_results_equal_a_local_sequential_run(batch):
    seen = batch["seen"]
    assert sorted(i for i, _ in seen) == list(range(len(CALLS)))  # each once
    got = dict(seen)
    expected = local_results(CALLS)
    for i, want in enumerate(expected):
        assert torch.equal(got[i], want), i
    # Control: another seed gives another result, so equality above means something.
    other = local_results([{**CALLS[0], "seed": 7}])[0]
    assert not torch.equal(other, expected[0])


def test_memory_requests_follow_the_measured_peak(batch, cluster):
    stream = batch["stream"]
    probe = load_summary(batch["traces"] / "probe.jsonl")
    assert stream.peak == probe.peak_footprint > SMALL_MEMORY
    # Ray's own accounting: the running workers hold peak bytes each of "memory".
    used, expected = batch["used"]
    assert used == expected and expected >= stream.peak
    assert stream.placement and {p["node_id"] for p in stream.placement.values()} == {
        cluster["head"]
    }
    # As many as fit: the node's 2 CPUs bound it here, not its memory ...
    assert fitting_workers(stream.peak, 1) == {cluster["head"]: 2}
    # ... and memory does once the peak is more than half of it; over all of it, none.
    assert fitting_workers(HEAD_MEMORY // 2 + 1, 1) == {cluster["head"]: 1}
    assert fitting_workers(HEAD_MEMORY + 1, 1) == {cluster["head"]: 0}


def test_a_node_with_too_little_memory_gets_no_worker(cluster):
    with pytest.raises(RuntimeError, match="no alive Ray node has room"):
        dict(stream_batch(MAKE, CALLS[:2], memory=HEAD_MEMORY + (1 << 20)))


def test_bad_memory_fails_before_ray_is_touched():
    with pytest.raises(ValueError, match="'8X'"):
        stream_batch(MAKE, CALLS, memory="8X")  # at the call, not at the first result
    with pytest.raises(TypeError, match="memory must be"):
        stream_batch(MAKE, CALLS, memory=True)


def test_each_worker_loads_each_model_once_per_chunk(batch):
    stream = batch["stream"]
    assert all(len(chunk) >= 2 for chunk in stream.chunks)  # several calls per chunk
    models = [m for ms in STAGES.values() for m in ms]
    for path in stream.traces:
        if path.name == "probe.jsonl":
            continue
        label = path.stem
        chunks = sum(1 for who in stream.ran.values() if who["label"] == label)
        loads = [e.model for e in read_trace(path).events if e.kind in ("load", "reload")]
        assert sorted(loads) == sorted(models * chunks), label
    # Control: the same calls run one after another in one process load per call.
    from stageload import ListSink, StagedModels

    pipe = MAKE()
    sink = ListSink()
    pipe.models = StagedModels(pipe.models._loaders, stages=STAGES, events=sink)
    for c in CALLS[:2]:
        pipe(**call_kwargs(c))
    assert sum(e.kind in ("load", "reload") for e in sink.events) == 2 * len(models)


def test_the_merged_report_has_one_column_per_worker(batch):
    stream = batch["stream"]
    text = report(batch["traces"])
    header = text.splitlines()[2]
    assert "probe" in header
    for label in stream.placement:
        assert label in header
    assert report(stream.traces) == text


@contextlib.contextmanager
def _killing_a_held_call(gate, holders=1):
    """While the block runs, a thread waits for ``holders`` calls held at ``gate`` (the
    toy's ``hold``), SIGKILLs the first one's process in the middle of its call, then
    opens the gate. Yields (killed pids, held pids), filled once that happened.

    States, not guesses: a held call waits for the gate however long its worker took to
    start (minutes on a busy machine), and the kill always lands inside a call."""
    killed: list[int] = []
    held: list[int] = []
    done = threading.Event()

    def kill_the_first_held() -> None:
        while not done.is_set():
            busy = sorted(int(p.name.split("-", 1)[1]) for p in gate.glob("busy-*"))
            if len(busy) >= holders:
                held.extend(busy)
                os.kill(busy[0], signal.SIGKILL)
                killed.append(busy[0])
                (gate / "open").touch()
                return
            done.wait(0.05)  # polling a folder: the workers have no other way to say it

    watcher = threading.Thread(target=kill_the_first_held, daemon=True)
    watcher.start()
    try:
        yield killed, held
    finally:
        done.set()
        (gate / "open").touch()  # a failed block leaves no call held
        watcher.join()


def _kill_a_held_worker(calls, max_restarts, gate):
    """Stream ``calls`` one per chunk on two workers, each call held at ``gate``; once
    both workers hold one, SIGKILL the first's process. (results, stream, killed, held)."""
    stream = stream_batch(
        MAKE, calls, memory="400M", workers=2, batch_size=1, max_restarts=max_restarts
    )
    with _killing_a_held_call(gate, holders=2) as (killed, held):
        seen = list(stream)
    return seen, stream, killed, held


def _held_calls(gate, n=6):
    return [{"prompt": i, "seed": i, "hold": str(gate)} for i in range(n)]


def test_a_worker_killed_mid_batch_loses_and_duplicates_nothing(cluster, tmp_path):
    calls = _held_calls(tmp_path)
    seen, stream, [pid], held = _kill_a_held_worker(calls, max_restarts=1, gate=tmp_path)
    assert sorted(i for i, _ in seen) == list(range(len(calls)))  # each once
    # The killed process finished no chunk; the other held worker did, and so did a new
    # process under the killed worker's label: Ray restarted it and ran its chunk there.
    (other,) = set(held) - {pid}
    ran = list(stream.ran.values())
    assert pid not in {w["pid"] for w in ran} and other in {w["pid"] for w in ran}, ran
    others_label = {w["label"] for w in ran if w["pid"] == other}
    restarted = {w["label"] for w in ran if w["pid"] not in held}
    assert restarted and restarted.isdisjoint(others_label), ran
    expected = local_results([{k: v for k, v in c.items() if k != "hold"} for c in calls])
    got = dict(seen)
    for i, want in enumerate(expected):
        assert torch.equal(got[i], want), i


def test_without_ray_restarts_the_killed_worker_ends_the_batch(cluster, tmp_path):
    # Control for the test above: with Ray's max_restarts=0 the same kill is fatal, so
    # it is Ray's restart that kept the batch whole there.
    with pytest.raises(RuntimeError, match="max_restarts=0"):
        _kill_a_held_worker(_held_calls(tmp_path), max_restarts=0, gate=tmp_path)


def test_max_restarts_is_checked_as_rays_option():
    with pytest.raises(ValueError, match="max_restarts.*-2"):
        stream_batch(MAKE, CALLS, max_restarts=-2)


def test_rows_of_a_batch_become_calls():
    import numpy as np
    import pandas as pd

    from stageload.ray import rows_to_calls

    batch = {
        "prompt": np.array(["a", "b"]),
        "seed": np.array([3, 4]),
        "steps": np.array([2, None], dtype=object),
    }
    calls = rows_to_calls(batch)
    assert calls == [{"prompt": "a", "seed": 3, "steps": 2}, {"prompt": "b", "seed": 4}]
    assert type(calls[0]["seed"]) is int  # np.int64 would fail call_kwargs' seed check
    assert rows_to_calls(pd.DataFrame({"prompt": ["a", "b"], "seed": [3, 4]})) == [
        {"prompt": "a", "seed": 3},
        {"prompt": "b", "seed": 4},
    ]
    with pytest.raises(TypeError, match="batch of rows"):
        rows_to_calls([{"prompt": "a"}])


def test_staged_predictor_runs_a_batch_here(tmp_path, monkeypatch):
    """Without Ray: the batch comes back with an ``images`` column equal to eager calls,
    numpy and pandas batches alike, and the trace lands in trace_dir."""
    import numpy as np
    import pandas as pd

    from stageload.core.outer import TRACE_ENV
    from stageload.ray import StagedPredictor

    monkeypatch.delenv(TRACE_ENV, raising=False)  # restored after: the runner sets it
    predictor = StagedPredictor(MAKE, trace_dir=tmp_path, threads=1)
    try:
        out = predictor({"prompt": np.array([1.0, 2.0]), "seed": np.array([5, 6])})
        frame = predictor(pd.DataFrame({"prompt": [1.0], "seed": [5]}))
    finally:
        predictor.finish()
    want = local_results([{"prompt": 1.0, "seed": 5}, {"prompt": 2.0, "seed": 6}])
    assert [torch.equal(a, b) for a, b in zip(out["images"], want, strict=True)] == [True] * 2
    assert list(out["seed"]) == [5, 6]  # the input columns stay
    assert isinstance(frame, pd.DataFrame) and torch.equal(frame["images"][0], want[0])
    (trace,) = tmp_path.glob("actor-*.jsonl")
    assert [m.label for m in read_trace(trace).marks] == ["batch 0", "batch 1"]


def _map_batches_killing_an_actor(tmp_path, rows, **remote_args):
    """map_batches(StagedPredictor) over ``rows``, held at the gate ``tmp_path/gate``,
    killing the actor in its first call: (output rows, killed pids)."""
    from stageload.ray import StagedPredictor

    gate = tmp_path / "gate"
    gate.mkdir()
    rows = [{**r, "hold": str(gate)} for r in rows]
    with _killing_a_held_call(gate) as (killed, _):
        out = (
            ray.data.from_items(rows)
            .map_batches(
                StagedPredictor,
                fn_constructor_args=(MAKE,),
                fn_constructor_kwargs={"trace_dir": str(tmp_path)},
                batch_size=2,
                concurrency=1,
                num_cpus=1,
                memory=400 << 20,
                **remote_args,
            )
            .take_all()
        )
    return out, killed


def test_map_batches_survives_an_actor_killed_mid_batch(cluster, tmp_path):
    """Ray Data's own fault tolerance: an actor SIGKILLed inside a batch is restarted and
    the batch retried; every row comes back once. Reference: ``local_results``, the same
    staged ToyPipeline called here one row at a time (not eager), with the torch threads of
    a 1-CPU Ray worker."""
    pytest.importorskip("ray.data")
    rows = [{"prompt": float(i), "seed": 200 + i} for i in range(6)]
    out, killed = _map_batches_killing_an_actor(tmp_path, rows)
    assert killed, "no call was held at the gate"
    assert sorted(int(r["seed"]) for r in out) == [r["seed"] for r in rows]  # each once
    traces = sorted(tmp_path.glob("actor-*.jsonl"))
    assert len(traces) == 2 and str(killed[0]) in traces[0].name + traces[1].name  # restarted
    want = dict(zip([r["seed"] for r in rows], local_results(rows), strict=True))
    for r in out:
        assert torch.equal(torch.from_numpy(r["images"].copy()), want[int(r["seed"])])


def test_map_batches_without_restarts_fails_on_the_same_kill(cluster, tmp_path):
    # Control for the test above: with Ray's max_restarts=0 the same kill ends the
    # dataset, so it is Ray Data's restart and retry that kept every row there.
    pytest.importorskip("ray.data")
    rows = [{"prompt": float(i), "seed": 200 + i} for i in range(6)]
    with pytest.raises(Exception) as failure:
        _map_batches_killing_an_actor(tmp_path, rows, max_restarts=0)
    text = f"{type(failure.value).__name__}: {failure.value}".lower()
    assert "actor" in text and "died" in text, text


def test_worker_threads_sets_a_ray_workers_count_and_restores_it(monkeypatch):
    from stageload.ray import ray_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [ray_threads(c) for c in (0.5, 1, 2.7)] == [1, 1, 2]  # Ray's rule
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert ray_threads(1) == 3  # a value set beforehand wins, in Ray as here
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    with worker_threads(1) as n:
        assert n == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_another_thread_count_can_round_differently():
    """Why worker_threads matters: a long reduction split over two threads rounds
    differently here (oneDNN/MKL on x86). Another BLAS may not split it: then skip."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 8192, generator=g), torch.randn(8192, 64, generator=g)
    with worker_threads(1):
        one = a @ b
    with worker_threads(2):
        two = a @ b
    if torch.equal(one, two):
        pytest.skip("this machine's matmul rounds the same with 1 and 2 threads")
    assert (one - two).abs().max() < 1e-2  # rounding, not a wrong result


def test_peak_memory_names_a_bad_row_before_ray_is_touched():
    from stageload.ray import peak_memory

    with pytest.raises(TypeError, match=r"row must be one call.*\['a cat'\]"):
        peak_memory(MAKE, ["a cat"])
    with pytest.raises(TypeError, match="'seed' must be an int, got 1.5"):
        peak_memory(MAKE, {"prompt": 1.0, "seed": 1.5})


def test_the_probe_runs_its_call_twice_so_its_peak_covers_a_reload(batch):
    # A worker's later batches reload what it released, and a reload can take more memory
    # than the first load (bench/results/ray-batch: 578 vs 339 MiB); the probe's second
    # run reloads, so its peak covers that.
    trace = read_trace(batch["traces"] / "probe.jsonl")
    (again,) = [m.t for m in trace.marks if m.label == "again"]
    loads = [(e.kind, e.t > again) for e in trace.events if e.kind in ("load", "reload")]
    assert [k for k, after in loads if not after] == ["load"] * 3  # first run: loads only
    assert [k for k, after in loads if after] and all(
        k == "reload" for k, after in loads if after
    )  # second run: reloads
