"""``torch.compile`` of a hooked module: the hooks run around the compiled forward, which
dynamo compiles whole, ``fullgraph=True`` included (the diffusers adapter's UNet:
tests/diffusers/test_diffusers_everyday.py).

Reference: the same class, built from the same seed with no stageload, compiled the same
way, in this process. dynamo's ``eager`` backend runs each graph as traced (a counting
backend around it): where staging meets torch.compile is tracing, guards and graph breaks,
not code generation."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch._dynamo  # imported before the first hook, as diffusers and transformers do
from torch import nn

from stageload import StagedModels
from stageload.hooks import registry
from stageload.hooks.registry import HookRegistry


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x)))


def make() -> Net:
    torch.manual_seed(3)
    return Net()


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model: nn.Module, how: str, graphs: list[int]) -> Any:
    def backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    if how == "method":
        model.compile(backend=backend, fullgraph=True)
        return model
    return torch.compile(model, backend=backend, fullgraph=True)


def staged_run(how: str) -> tuple[torch.Tensor, list[int]]:
    graphs: list[int] = []
    models = StagedModels({"net": make, "other": make}, stages={"a": ["net"], "b": ["other"]})
    with models:
        models.enter("a")
        net = models["net"]
        assert HookRegistry.of(net) is not None  # hooked: its calls are counted
        out = compiled(net, how, graphs)(torch.ones(4, 16))
        models.enter("b")
        assert all(p.is_meta for p in net.parameters())  # released after the compiled call
    return out, graphs


@pytest.mark.parametrize("how", ["method", "assign"])
def test_a_hooked_module_compiles_with_fullgraph_to_eagers_one_graph(how: str) -> None:
    want_graphs: list[int] = []
    want = compiled(make(), how, want_graphs)(torch.ones(4, 16))
    torch._dynamo.reset()
    got, graphs = staged_run(how)
    assert torch.equal(got, want)
    assert graphs == want_graphs and len(graphs) == 1


def test_control_hooks_left_to_dynamo_fail_fullgraph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with the marks undone: the hooks' torch.compiler.disable, and the skip of
    ``__call__``'s frame (a copy of the function: a code object dynamo was not told of)."""
    HookRegistry.attach(nn.Linear(1, 1))  # marks made (at a hook made once dynamo is imported)
    monkeypatch.setattr(registry, "_before", registry._before.__wrapped__)
    monkeypatch.setattr(registry, "_after", registry._after.__wrapped__)
    call = registry._HookedForward.__call__
    plain = types.FunctionType(call.__code__.replace(), call.__globals__, call.__name__)
    monkeypatch.setattr(registry._HookedForward, "__call__", plain)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="get_ident"):
        staged_run("assign")
