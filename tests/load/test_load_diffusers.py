"""The diffusers adapter reloads components with load_weights, bit for bit as from_pretrained.

Reference: the component's own ``from_pretrained`` (``_load_component``), in this process.
Values only: parameters and buffers are compared, no model runs, so any thread count."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import torch  # noqa: E402
from diffusers import FluxPipeline  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import stageload.diffusers as sd  # noqa: E402
from stageload import ListSink  # noqa: E402
from stageload.diffusers import staged_pipeline  # noqa: E402
from stageload.load.checkpoint import pretrained_checkpoint  # noqa: E402
from stageload.load.refill import Recipe, learn  # noqa: E402

try:  # the fixtures' home after the layout change, and before it
    from stageload.testing import diffusers as fixtures  # type: ignore[attr-defined]
except ImportError:
    from stageload.diffusers import fixtures


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Flux: CLIP and T5 (transformers; T5's tied embedding, its float32 'wo' layers,
    # CLIP's computed position_ids), a diffusers transformer and VAE.
    return fixtures.build("flux", tmp_path_factory.mktemp("flux") / "flux")


@pytest.fixture
def from_pretrained_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    calls: list[str] = []
    real = sd._load_component

    def counted(cls: type, folder: Path, *args: Any, **kwargs: Any) -> Any:
        calls.append(folder.name)
        return real(cls, folder, *args, **kwargs)

    monkeypatch.setattr(sd, "_load_component", counted)
    yield calls


def _everything(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer, computed (non-persistent) ones included."""
    out = {}
    for prefix, sub in module.named_modules():
        for slot in (sub._parameters, sub._buffers):
            for key, t in slot.items():
                if t is not None:
                    out[f"{prefix}.{key}" if prefix else key] = t
    return out


@pytest.mark.parametrize("dtype", (None, torch.bfloat16))
def test_reloads_read_the_files_and_equal_from_pretrained(flux, from_pretrained_calls, dtype):
    pipe = staged_pipeline(FluxPipeline, flux, torch_dtype=dtype, keep=())
    models = pipe.stageload.models
    for name in models:
        first = models[name]
        models.evict(name)
        calls = len(from_pretrained_calls)
        again = models[name]
        assert again is first is getattr(pipe, name)  # the placeholder, filled in place
        assert len(from_pretrained_calls) == calls, f"{name} reloaded with from_pretrained"
        reference = _everything(
            sd._load_component(pipe.stageload._classes[name], flux / name, dtype, {})
        )
        got = _everything(again)
        assert got.keys() == reference.keys(), name
        for key, ref in reference.items():
            assert got[key].dtype == ref.dtype, (name, key)
            assert torch.equal(got[key], ref), (name, key)
    t5 = pipe.text_encoder_2
    assert t5.shared.weight is t5.encoder.embed_tokens.weight  # tied stays tied


def test_renamed_keys_fall_back_to_from_pretrained_with_a_note(
    flux, tmp_path, from_pretrained_calls
):
    # An old VAE checkpoint: diffusers renames its mid-block attention keys on load.
    path = tmp_path / "flux"
    shutil.copytree(flux, path)
    file = path / "vae" / "diffusion_pytorch_model.safetensors"
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    state = {}
    for key, value in load_file(str(file)).items():
        for new, legacy in old.items():
            key = key.replace(f"mid_block.attentions.0.{new}.", f"mid_block.attentions.0.{legacy}.")
        state[key] = value
    assert any(".query." in k for k in state)
    save_file(state, str(file), metadata={"format": "pt"})

    sink = ListSink()
    pipe = staged_pipeline(FluxPipeline, path, keep=(), events=sink)
    models = pipe.stageload.models
    models["vae"]
    models.evict("vae")
    models["vae"]
    assert from_pretrained_calls.count("vae") == 2
    notes = [e.note for e in sink.events if e.kind == "note" and e.model == "vae"]
    said = "vae reloads with from_pretrained: the checkpoint does not hold its tensors"
    assert any(said in n for n in notes), notes
    reference = _everything(
        sd._load_component(pipe.stageload._classes["vae"], path / "vae", None, {})
    )
    for key, ref in reference.items():
        assert torch.equal(_everything(pipe.vae)[key], ref), key


def test_learn_refuses_values_that_differ_from_the_file(flux):
    files = pretrained_checkpoint(flux / "transformer", {})
    assert isinstance(files, list)
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(flux / "transformer")
    assert isinstance(learn(model, files), Recipe)
    # Control: a conversion on load that keeps the keys (here: one value changed).
    with torch.no_grad():
        model.proj_out.weight.view(-1)[0] += 1
    assert "'proj_out.weight' differs from the file's" in str(learn(model, files))


def test_pretrained_checkpoint_follows_variant_and_use_safetensors(flux):
    assert (
        pretrained_checkpoint(flux / "vae", {"use_safetensors": False}) == "use_safetensors=False"
    )
    assert "for variant 'fp16'" in str(pretrained_checkpoint(flux / "vae", {"variant": "fp16"}))


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_a_sharded_variant_checkpoint_is_its_shards(
    flux: Path, tmp_path: Path, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transformer saved sharded under variant fp16 (``...safetensors.index.fp16.json``,
    which does not end in ``.index.json``): its checkpoint is the shards the index names,
    holding every tensor of the model, so a reload is learned from them. It was the index
    JSON itself, taken for a safetensors file. Control: the index read as a plain file."""
    from diffusers import FluxTransformer2DModel

    import stageload.load.checkpoint as checkpoint

    if not fixed:
        monkeypatch.setattr(checkpoint, "_index_files", lambda index: [index])
    model = FluxTransformer2DModel.from_pretrained(flux / "transformer")
    model.save_pretrained(tmp_path, variant="fp16", max_shard_size="50KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.fp16.json").is_file()
    files = pretrained_checkpoint(tmp_path, {"variant": "fp16"})
    assert isinstance(files, list)
    assert all(f.name.endswith(".safetensors") for f in files) == fixed
    if fixed:
        assert len(files) > 1
        assert isinstance(learn(model, files), Recipe)
