"""release() of weights an autograd graph still holds: the memory comes back, and a backward
through that graph raises autograd's own error, never reads the freed memory.

The scripts people write: textual inversion (a frozen text encoder, the embeddings it
reads trained, the encoder released at the next stage), a frozen critic mid-graph, and
inference that forgot ``torch.no_grad()``. Freed under the graph, the backward failed deep
in a kernel or crashed the interpreter; the controls run without the version bump, in a
subprocess, since that may be a segmentation fault."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from stageload import ListSink, StagedModels, release
from stageload.hooks.registry import HookRegistry, ModuleHook
from stageload.hooks.release import held_by_autograd, module_bytes

INPLACE = "modified by an inplace operation"


def encoder() -> nn.Module:
    """A frozen encoder whose weights a graph saves as they are (LayerNorm) and as views
    (a Linear's ``weight.t()``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32)).requires_grad_(
        False
    )


def conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).requires_grad_(False)


def embedding_input() -> torch.Tensor:
    return nn.Parameter(torch.randn(4, 32, generator=torch.Generator().manual_seed(1)))


def image_input() -> torch.Tensor:
    return torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(1)).requires_grad_()


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "layernorm-linear": (encoder, embedding_input),
    "conv-batchnorm": (conv, image_input),
}


@pytest.mark.parametrize("case", CASES)
def test_a_backward_through_released_weights_raises_instead_of_reading_them(case):
    build, make_input = CASES[case]
    model, x = build(), make_input()
    size = module_bytes(model)
    out = model(x)
    with pytest.warns(UserWarning, match=r"model 'enc' was released while an autograd graph"):
        freed = release(model, name="enc")
    assert freed == size  # the memory comes back, graph or not
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()


CONTROL = """
import torch
from torch import nn
import stageload.hooks.release as r
from stageload import release
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).requires_grad_(False)
x = torch.randn(1, 3, 12, 12).requires_grad_()
model(x).sum().backward()
want = x.grad.clone()
x.grad = None
r._cut_from_autograd = lambda module, kept_storage, kept_modules, done, *_: setattr(done, "cut", 0)
out = model(x)
release(model)
print("released", flush=True)
out.sum().backward()
print("equal" if torch.equal(x.grad, want) else "differs")
"""


def test_control_without_the_bump_the_backward_reads_the_freed_weights():
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CONTROL)], capture_output=True, text=True
    )
    # The release went through (no error of the script's own), then: a segmentation fault
    # (rc < 0), a kernel's error on the freed memory, or a gradient from it. Never
    # autograd's refusal, never the right gradient.
    assert proc.stdout.startswith("released"), proc.stderr
    assert INPLACE not in proc.stderr, proc.stderr
    assert proc.returncode != 0 or proc.stdout == "released\ndiffers\n", proc.stderr


def test_calls_under_no_grad_or_inference_mode_release_without_a_word():
    model = encoder()
    for mode in (torch.no_grad, torch.inference_mode):
        model = encoder()
        with mode():
            out = model(embedding_input())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            release(model)
        del out


def test_a_model_released_before_the_backward_of_its_own_training_is_said():
    """A trained Linear whose input needs no gradient: the graph saves the input, not the
    weight, but its gradient accumulator holds the weight, to receive the gradient. Said
    as held; torch refuses the backward itself (``swap_tensors`` marks the accumulator of
    a tensor it swapped)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    out = model(torch.randn(2, 8))
    assert held_by_autograd(model.weight)
    with pytest.warns(UserWarning, match="an autograd graph held"):
        release(model)
    with pytest.raises(RuntimeError, match="poisoned by swap_tensors"):
        out.sum().backward()


def test_a_model_whose_graph_is_gone_is_not_held():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    out = model(torch.randn(2, 8))
    out.sum().backward()
    del out  # the graph goes, and its accumulator with it
    assert not held_by_autograd(model.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        release(model)


def test_a_view_the_script_keeps_counts_as_held_and_its_weight_as_not_once_dropped():
    model = nn.Linear(8, 8)
    view = model.weight[0:2]
    assert held_by_autograd(model.weight)
    del view
    assert not held_by_autograd(model.weight)


def textual_inversion(models: StagedModels) -> torch.Tensor:
    """One step: the trained embeddings through the frozen encoder (stage 'encode'), a
    head (stage 'denoise'), backward."""
    torch.manual_seed(2)
    embeddings = embedding_input()
    models.enter("encode")
    hidden = models["encoder"](embeddings)
    models.enter("denoise")
    models["head"](hidden).pow(2).mean().backward()
    return embeddings.grad


def loaders() -> dict[str, Callable[[], nn.Module]]:
    def head() -> nn.Module:
        torch.manual_seed(3)
        return nn.Linear(32, 1)

    return {"encoder": encoder, "head": head}


def test_a_staged_step_that_releases_the_encoder_says_so_and_the_backward_refuses():
    sink = ListSink()
    stages = {"encode": ["encoder"], "denoise": ["head"]}
    models = StagedModels(loaders(), stages=stages, events=sink)
    with (
        pytest.warns(UserWarning, match="model 'encoder' was released while"),
        pytest.raises(RuntimeError, match=INPLACE),
    ):
        textual_inversion(models)
    (note,) = [e.note for e in sink.events if e.kind == "release" and e.model == "encoder"]
    assert "an autograd graph held" in note and "keep it loaded" in note


def test_the_warning_points_at_the_scripts_line_once_per_line():
    """At ``models.enter(...)`` in the script (this file), not in stageload: the filter
    shows it once per line, where the script can change it."""
    models = StagedModels(loaders(), stages={"encode": ["encoder"], "denoise": ["head"]})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        for _ in range(3):
            models.enter("encode")
            hidden = models["encoder"](embedding_input())
            models.enter("denoise")  # the line said
        del hidden
    assert len(said) == 1 and said[0].filename == __file__, [(w.filename, w.lineno) for w in said]


@pytest.mark.parametrize("recorded_first", [True, False], ids=["fixed", "control"])
def test_with_warnings_as_errors_the_release_is_recorded_before_the_warning_raises(
    recorded_first, monkeypatch
):
    """``python -W error``: the warning raises out of ``enter()``, after the release event
    is in the trace (the model is released whole either way). Control: warned from inside
    ``release()`` (no ``on_cut``), the event was lost."""
    import stageload.core.staged as staged

    if not recorded_first:
        real = staged.release
        monkeypatch.setattr(staged, "release", lambda *a, on_cut=None, **k: real(*a, **k))
    sink = ListSink()
    models = StagedModels(
        loaders(), stages={"encode": ["encoder"], "denoise": ["head"]}, events=sink
    )
    models.enter("encode")
    encoder = models["encoder"]
    hidden = encoder(embedding_input())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="model 'encoder' was released while"):
            models.enter("denoise")
    assert all(t.is_meta for t in encoder.parameters())
    released = [e.model for e in sink.events if e.kind == "release"]
    assert released == (["encoder"] if recorded_first else [])
    del hidden


def test_kept_loaded_through_the_backward_the_staged_step_equals_eager():
    eager = {name: load() for name, load in loaders().items()}
    want = textual_inversion(_Eager(eager))
    stages = {"encode": ["encoder"], "denoise": ["encoder", "head"]}  # the way out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = textual_inversion(StagedModels(loaders(), stages=stages))
    assert torch.equal(got, want)


class _Eager:
    """The models built up front: what textual_inversion asks of StagedModels."""

    def __init__(self, models: dict[str, nn.Module]) -> None:
        self.models = models

    def enter(self, stage: str) -> None:
        pass

    def __getitem__(self, name: str) -> Any:
        return self.models[name]


def test_gradients_a_staged_release_drops_are_said_at_the_reload():
    """StagedModels reloads through the loader: a model released with gradients in it
    comes back without them (a step accumulated over two stages loses the first part).
    Said at the reload, as a change the release dropped."""
    sink = ListSink()
    models = StagedModels(loaders(), stages={"train": ["head"], "other": ["encoder"]}, events=sink)
    models.enter("train")
    models["head"](torch.randn(2, 32)).sum().backward()
    models.enter("other")
    models.enter("train")
    with pytest.warns(UserWarning, match=r"gradients accumulated in weight\.grad"):
        head = models["head"]
    assert head.weight.grad is None
    assert any("gradients accumulated in weight.grad" in (e.note or "") for e in sink.events)


class _Keeps(ModuleHook):
    """Keeps the tensors it is given through a release, as the diffusers adapter keeps a
    user's edit of a staged component."""

    def __init__(self, *kept: torch.Tensor) -> None:
        self.kept = kept

    def retain(self, module: nn.Module) -> list[torch.Tensor]:
        return list(self.kept)


def test_what_a_hook_keeps_through_a_release_still_serves_the_backward():
    torch.manual_seed(0)
    norm = nn.LayerNorm(32).requires_grad_(False)
    x = embedding_input()
    norm(x).pow(2).sum().backward()
    want, x.grad = x.grad, None
    HookRegistry.attach(norm).add("keeps", _Keeps(norm.weight, norm.bias))
    out = norm(x)
    release(norm)
    assert not norm.weight.is_meta  # kept
    out.pow(2).sum().backward()  # the kept weights' versions are as the graph saved them
    assert torch.equal(x.grad, want)


def test_control_kept_tensors_taken_for_released_ones_refuse_the_backward(monkeypatch):
    import stageload.hooks.release as release_module

    def every_parameter(module: nn.Module, *_: Any) -> Any:  # the kept ones included
        return ((t, 0) for t in module.parameters())

    monkeypatch.setattr(release_module, "_to_release", every_parameter)
    norm = nn.LayerNorm(32).requires_grad_(False)
    HookRegistry.attach(norm).add("keeps", _Keeps(norm.weight, norm.bias))
    out = norm(embedding_input())
    release(norm)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.pow(2).sum().backward()


class _CountsRetains(_Keeps):
    """Counts how often a release asks it what to keep."""

    asked = 0

    def retain(self, module: nn.Module) -> list[torch.Tensor]:
        self.asked += 1
        return super().retain(module)


@pytest.mark.parametrize("once", [True, False], ids=["once", "control"])
def test_a_release_asks_each_hook_what_it_keeps_once(monkeypatch, once: bool):
    """Each hook's ``retain`` walks the module's tensors (the diffusers adapter counts
    their holders): a release asks it once, not once more for the autograd check. Control:
    the check asking again, it is asked twice."""
    import stageload.hooks.release as release_module

    if not once:
        held = release_module._autograd_held
        monkeypatch.setattr(
            release_module,
            "_cut_from_autograd",
            lambda module, kept_storage, kept_modules, done, retained: setattr(
                done, "cut", held(module, kept_storage, kept_modules, cut=True)
            ),
        )
    norm = nn.LayerNorm(32).requires_grad_(False)
    hook = _CountsRetains(norm.weight)
    HookRegistry.attach(norm).add("keeps", hook)
    release(norm)
    assert norm.bias.is_meta and not norm.weight.is_meta
    assert hook.asked == (1 if once else 2)
