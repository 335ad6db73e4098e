"""stageload.ray across two simulated nodes of different memory (ray.cluster_utils.Cluster):
Ray Data's ``map_batches`` with ``StagedPredictor``, and ``stream_batch``.

Its own module: a Cluster needs its own Ray connection, after test_ray's is shut down.
Every node binds 127.0.0.1, checked below.
"""

from __future__ import annotations

import os
from functools import partial

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep 127.0.0.1 as given (see test_ray)
ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("ray.data")  # makes ray.data an attribute of ray

from ray.cluster_utils import Cluster  # noqa: E402

from stageload.ray import (  # noqa: E402
    StagedPredictor,
    call_kwargs,
    peak_memory,
    report,
    stream_batch,
    worker_threads,
)
from stageload.ray._stream import fitting_workers  # noqa: E402
from stageload.report.records import read_trace  # noqa: E402
from stageload.testing.ray import STAGES, make_toy  # noqa: E402

LOOPBACK = "127.0.0.1"
MAKE = partial(make_toy, 256)
MODELS = [m for ms in STAGES.values() for m in ms]
SMALL, BIG = 64 << 20, 4 << 30  # the small node holds less than one worker's peak
# Ray reads its own settings in this case: the raylet's patience on a busy machine.
WAIT = "RAY_raylet_start_wait_time_s"


@pytest.fixture(scope="module")
def two_nodes():
    saved = os.environ.get(WAIT)
    os.environ[WAIT] = "300"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "memory": SMALL,
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
        },
    )
    try:
        big = cluster.add_node(num_cpus=2, memory=BIG, node_ip_address=LOOPBACK)
        ray.init(address=cluster.address, _node_ip_address=LOOPBACK, log_to_driver=False)
        cluster.wait_for_nodes()
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert sorted(n["NodeManagerAddress"] for n in nodes) == [LOOPBACK, LOOPBACK]
        yield {"big": big.node_id, "small": cluster.head_node.node_id}
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop(WAIT, None)
        else:
            os.environ[WAIT] = saved


def test_the_node_with_too_little_memory_gets_no_worker(two_nodes):
    calls = [{"prompt": i, "seed": 100 + i, "steps": 2} for i in range(5)]
    stream = stream_batch(partial(make_toy, 256), calls)
    results = dict(stream)
    assert sorted(results) == list(range(5))  # every call once
    assert stream.peak > SMALL  # the measured peak does not fit the small node ...
    fits = fitting_workers(stream.peak, 1)
    assert fits[two_nodes["small"]] == 0 and fits[two_nodes["big"]] >= 1
    # ... so every worker was placed on the big one.
    placed = {w["node_id"] for w in stream.placement.values()}
    assert placed == {two_nodes["big"]}, stream.placement


def _run_on(node_id: str) -> str:
    """The node id a trivial task pinned to ``node_id`` ran on (for the controls)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where = ray.remote(num_cpus=1)(lambda: ray.get_runtime_context().get_node_id())
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.get(where.options(scheduling_strategy=strategy).remote(), timeout=120)


def test_map_batches_with_staged_predictor(two_nodes, tmp_path):
    traces = tmp_path / "traces"
    rows = [{"prompt": float(i), "seed": 100 + i, "steps": 2} for i in range(8)]
    ds = ray.data.from_items(rows)
    peak = peak_memory(MAKE, ds.take(1)[0], trace_dir=traces)
    out = ds.map_batches(
        StagedPredictor,
        fn_constructor_args=(MAKE,),
        fn_constructor_kwargs={"trace_dir": str(traces)},
        batch_size=2,
        concurrency=2,
        num_cpus=1,
        memory=peak,
    ).take_all()

    # Bit for bit equal to eager calls here, with the threads of a 1-CPU worker.
    pipe = MAKE()
    with worker_threads(1) as threads:
        eager = {r["seed"]: pipe(**call_kwargs(r)) for r in rows}
    assert sorted(int(r["seed"]) for r in out) == sorted(eager)  # each row once
    for r in out:
        assert torch.equal(torch.from_numpy(r["images"].copy()), eager[int(r["seed"])])
    # Control: another seed gives another output, so the equality above means something.
    assert not torch.equal(pipe(**call_kwargs({**rows[0], "seed": 7})), eager[100])

    actors = sorted(traces.glob("actor-*.jsonl"))
    assert actors, sorted(traces.iterdir())
    batches = 0
    for path in actors:
        trace = read_trace(path)
        assert trace.meta["threads"] == threads == 1
        # Each model loads once per batch: one mark per batch, 3 loads per mark (an
        # actor that Ray Data gave no batch loaded nothing).
        n = sum(m.label.startswith("batch ") for m in trace.marks)
        loads = [e.model for e in trace.events if e.kind in ("load", "reload")]
        assert sorted(loads) == sorted(MODELS * n), path.name
        batches += n
        # The node too small for the measured peak got no actor.
        assert trace.meta["node_id"] == two_nodes["big"], path.name
    assert batches == len(rows) // 2
    assert peak > SMALL and fitting_workers(peak, 1)[two_nodes["small"]] == 0
    # Controls: the small node runs work (a task pinned there), and a request it can hold
    # would fit there: only the measured memory= kept the actors off it.
    assert _run_on(two_nodes["small"]) == two_nodes["small"]
    assert fitting_workers(SMALL // 2, 1)[two_nodes["small"]] == 1
    text = report(traces)
    assert "probe" in text and all(p.stem in text for p in actors)
