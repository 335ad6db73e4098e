"""stageload.ray across two simulated nodes of different memory (ray.cluster_utils.Cluster).

Its own module: a Cluster needs its own Ray connection, after test_ray's is shut down.
Every node binds 127.0.0.1, checked below.
"""

from __future__ import annotations

import os
from functools import partial

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep 127.0.0.1 as given (see test_ray)
ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from ray.cluster_utils import Cluster  # noqa: E402

from stageload.ray import stream_batch  # noqa: E402
from stageload.ray._stream import fitting_workers  # noqa: E402
from stageload.testing.ray import make_toy  # noqa: E402

LOOPBACK = "127.0.0.1"
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
