"""``release`` frees dead reference cycles (issue 36, item 2): one ``gc.collect()`` per
``release()`` or per ``enter()``'s batch of releases, not one per module.

Collections are counted with ``gc.callbacks`` (every full collection reports there, the
disabled collector's explicit ones included). A cycle's tensor is watched with a weakref:
gone means its memory went back to the allocator. Controls take the collection away.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import stageload.hooks.release as release_module
from fixtures.traces import MIB
from stageload import StagedModels, release
from stageload.hooks.registry import HookRegistry, ModuleHook


class Cycle:
    """An object that refers to itself and holds a tensor: garbage only a collection frees."""

    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.zeros(nbytes // 4)
        self.me = self


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The automatic collector off, as in a process that disabled it (or never reached a
    threshold): only an explicit collection frees a cycle."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


@pytest.fixture
def full_collections() -> Iterator[list[int]]:
    """A list that grows by one at every full collection while the test runs."""
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(count)
    yield seen
    gc.callbacks.remove(count)


def dead_cycle() -> weakref.ref[torch.Tensor]:
    cycle = Cycle(MIB)
    watched = weakref.ref(cycle.tensor)
    del cycle
    return watched


def test_release_frees_a_dead_cycle_holding_a_mebibyte(collector_off):
    watched = dead_cycle()
    assert watched() is not None  # unreachable, yet alive: the collector is off
    release(nn.Linear(4, 4))
    assert watched() is None


def test_control_without_the_collection_the_cycle_survives_the_release(collector_off, monkeypatch):
    monkeypatch.setattr(release_module, "collect_garbage", lambda: None)
    watched = dead_cycle()
    release(nn.Linear(4, 4))
    assert watched() is not None


def three_models() -> StagedModels:
    return StagedModels(
        {name: (lambda: nn.Linear(64, 64)) for name in ("a", "b", "c")},
        stages={"all": ["a", "b", "c"], "none": []},
    )


def test_entering_a_stage_collects_once_for_all_its_releases(collector_off, full_collections):
    models = three_models()
    models.enter("all")
    for name in ("a", "b", "c"):
        models[name]
    watched = dead_cycle()
    full_collections.clear()
    models.enter("none")  # three releases
    assert len(full_collections) == 1
    assert watched() is None
    models.enter("all")  # releases nothing: no collection
    assert len(full_collections) == 1


def test_control_releases_outside_a_batch_collect_once_each(collector_off, full_collections):
    # The same three releases, called one by one: three collections, what releasing()
    # saves an enter().
    modules = [nn.Linear(64, 64) for _ in range(3)]
    full_collections.clear()
    for module in modules:
        release(module)
    assert len(full_collections) == 3


def test_a_release_from_inside_a_hooked_call_does_not_collect(full_collections):
    # A streamed block is released by a hook after its forward, inside the model's call: a
    # forward must not pay a full collection per block.
    block = nn.Linear(4, 4)

    class ReleaseAfter(ModuleHook):
        def post_call(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
            release(block)
            return output

    outer = nn.Sequential(nn.Linear(4, 4))
    HookRegistry.attach(outer).add("test", ModuleHook())
    HookRegistry.attach(outer[0]).add("test", ReleaseAfter())
    full_collections.clear()
    outer(torch.zeros(1, 4))
    assert full_collections == []
    assert release_module.is_released(block)
