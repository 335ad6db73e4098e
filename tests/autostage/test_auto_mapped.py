"""Weights a library leaves mapped from the file stay mapped at auto's reloads.

transformers maps a safetensors checkpoint whose dtype needs no conversion (float32 kept
float32, on a CPU): those pages are page cache, which the footprint (RssAnon + RssShmem)
does not count and the kernel may drop and read again. Read into the process's own
memory at each reload, a model counted in full under auto where it did not without it:
three 49 MB GPT-2s with room for one peaked at 309 MiB under auto against 256 MiB alone
(helper-47). Now a reload maps what the first load had mapped, at the same alignment.
Linux only: the mappings are read from /proc/self/maps.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

import stageload.autostage
from stageload import ListSink, auto
from stageload.external import torch_function_off
from stageload.load import refill

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mapped")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=2000)
    transformers.GPT2Model(config).save_pretrained(path / "g")
    bert = transformers.BertConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256
    )
    transformers.BertModel(bert).save_pretrained(path / "b")
    return path


def _mapped_share(model: torch.nn.Module, file: Path) -> float:
    """The share of ``model``'s tensors that lie in a mapping of ``file``."""
    ranges = refill.mapped_ranges([file]).get(file, [])
    ptrs = [p.data_ptr() for p in model.parameters()]
    return sum(any(lo <= x < hi for lo, hi in ranges) for x in ptrs) / len(ptrs)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "control"])
def test_a_reload_maps_what_the_first_load_mapped(folder, mapped, monkeypatch):
    """Room for one model, three laps: after each reload, every tensor of the GPT-2 lies
    in a mapping of its file, and the outputs equal the script's alone (this process).
    Control: with the recipe's mapped set emptied, the reloads read the weights into the
    process's own memory, and none is mapped."""
    if not mapped:
        learn = refill.learn

        def unmapped(*args, **kwargs):
            recipe = learn(*args, **kwargs)
            if not isinstance(recipe, str):
                recipe.mapped = frozenset()
            return recipe

        monkeypatch.setattr(stageload.autostage, "learn", unmapped)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    file = folder / "g" / "model.safetensors"

    def run(shares: list[float]) -> list[torch.Tensor]:
        g = transformers.GPT2Model.from_pretrained(folder / "g")
        b = transformers.BertModel.from_pretrained(folder / "b")
        outs = []
        with torch.no_grad():
            for _ in range(3):
                outs.append(g(ids).last_hidden_state)
                shares.append(_mapped_share(g, file))
                outs.append(b(ids).last_hidden_state)
        return outs

    alone: list[float] = []
    want = run(alone)
    assert alone == [1.0] * 3  # transformers maps them
    sink = ListSink()
    shares: list[float] = []
    with auto(budget=1, events=sink):
        got = run(shares)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [e.note for e in sink.events if e.kind == "reload" and e.model == "g"] == ["files"] * 2
    # The first use loads through from_pretrained (mapped either way); then the reloads.
    assert shares[1:] == ([1.0, 1.0] if mapped else [0.0, 0.0])


class _Interrupt:
    """``refill.put`` that raises KeyboardInterrupt at its ``at``-th call, as a Ctrl-C
    between two tensors of a reload does."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.put = at, 0, refill.put

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.put(*args, **kwargs)


@pytest.mark.parametrize("undone", [False, True], ids=["released", "control"])
def test_a_mapped_reload_interrupted_leaves_the_model_released_whole(folder, undone, monkeypatch):
    """A Ctrl-C after three of the GPT-2's tensors were mapped again: the reload raises
    it, and every tensor is back on meta, as before the reload (not three mapped and the
    rest empty). Control: with the reload's release on an interruption undone, the three
    stay mapped."""
    from stageload.hooks.release import release

    model = transformers.GPT2Model.from_pretrained(folder / "g")
    recipe = refill.learn(model, [folder / "g" / "model.safetensors"], made_new=True)
    assert not isinstance(recipe, str) and recipe.mapped
    release(model)
    if undone:
        monkeypatch.setattr(refill, "release", lambda module: None)
    monkeypatch.setattr(refill, "put", _Interrupt(at=4))
    with pytest.raises(KeyboardInterrupt):
        refill.reload(model, recipe, torch.device("cpu"), progress=False)
    assert sum(not p.is_meta for p in model.parameters()) == (3 if undone else 0)


def test_auto_uses_a_model_again_after_a_reload_interrupted(folder, monkeypatch):
    """Under auto, the interrupted reload leaves the GPT-2 released, and its next use
    reloads it and gives the output it gave before, bit for bit (the same process)."""
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with auto(budget=1), torch.no_grad():
        g = transformers.GPT2Model.from_pretrained(folder / "g")
        b = transformers.BertModel.from_pretrained(folder / "b")
        want = g(ids).last_hidden_state
        b(ids)  # g released for it
        with monkeypatch.context() as patched:
            patched.setattr(refill, "put", _Interrupt(at=4))
            with pytest.raises(KeyboardInterrupt):
                g(ids)
        with torch_function_off():  # a released model's tensors answer False to the script
            assert all(p.is_meta for p in g.parameters())
        assert torch.equal(g(ids).last_hidden_state, want)


def _map_through_safetensors(module, recipe, names):
    """The reload's mapping as it was: safetensors' ``get_tensor``, for the control."""
    from safetensors import safe_open

    for target in refill.targets(module):
        key = refill._key(target, names or {})
        if target.tensor.is_meta and key in recipe.mapped:
            with safe_open(str(recipe.files[0]), framework="pt") as opened:
                refill.put(target, opened.get_tensor(key))


def _open_files() -> list[str]:
    """What this process's file descriptors name."""
    named = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, closed by now
            named.append(os.readlink(f"/proc/self/fd/{fd}"))
    return named


@pytest.mark.parametrize("through", ["own", "safetensors"], ids=["mapped", "control"])
def test_mapped_reloads_leave_no_memory_behind(folder, through, monkeypatch):
    """Releases and mapped reloads of the GPT-2, 50 laps after 50: the Python memory
    allocated (tracemalloc) grows by under 16 KiB over the second 50 (the first fill
    one-off caches), and no mapping of the file is left after the last release.
    Control: mapped through safetensors' ``get_tensor``, each reload kept about 28 bytes
    a tensor for good (31,281 blocks in 200 laps of a long run, helper-49): 180 KiB in
    100 laps here."""
    import gc
    import tracemalloc

    from stageload.hooks.release import release

    if through == "safetensors":
        monkeypatch.setattr(refill, "_map", _map_through_safetensors)
    file = folder / "g" / "model.safetensors"
    model = transformers.GPT2Model.from_pretrained(folder / "g")
    recipe = refill.learn(model, [file], made_new=True)
    assert not isinstance(recipe, str)

    def laps(n: int) -> int:
        for _ in range(n):
            release(model)
            refill.reload(model, recipe, torch.device("cpu"), progress=False)
            assert _mapped_share(model, file) == 1.0
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        first = laps(50)
        grown = laps(50) - first
    finally:
        tracemalloc.stop()
    assert (grown < 16 * 1024) == (through == "own"), grown
    if through == "own":  # Python 3.13's mmap closes its descriptor (trackfd=False);
        # before, the map keeps one open while its tensors live (safetensors' keeps none)
        assert (str(file.resolve()) in _open_files()) == (sys.version_info < (3, 13))
    # Each tensor at version 0, as a read leaves it: auto takes a higher one for the
    # script's write (views of one tensor over the file would share one version).
    assert all(p._version == 0 for p in model.parameters())
    release(model)
    gc.collect()
    assert refill.mapped_ranges([file]) == {}
