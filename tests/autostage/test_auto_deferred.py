"""What may change between a ``from_pretrained`` under auto and the model's first use, which
is when auto reads it: the working directory, torch's default dtype, the files themselves.
Each found by a new-user helper; each test against the same code without auto (eager, in
this process), each with a control that fails once the mechanism is taken away."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import stageload.autostage  # noqa: E402
from stageload import CheckpointError, ModelLoadError, auto  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return folder(FAMILIES["sd"], tmp_path_factory.mktemp("deferred") / "sd")


def latents(vae: Any) -> torch.Tensor:
    shape, seeded = (1, vae.config.latent_channels, 8, 8), torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=seeded, dtype=torch.float32)


def decode(vae: Any) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(latents(vae)).sample


def eager_image(sd: Path) -> torch.Tensor:
    return decode(diffusers.AutoencoderKL.from_pretrained(sd, subfolder="vae"))


def after_chdir(sd: Path, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """``from_pretrained("sd", ...)`` relative to the folder above, then ``chdir`` away."""
    monkeypatch.chdir(sd.parent)
    with auto(budget=1):
        vae = diffusers.AutoencoderKL.from_pretrained(sd.name, subfolder="vae")
        os.chdir(sd)  # the script moves on: "sd" means nothing here
        return decode(vae)


def test_a_relative_path_loads_what_it_named_after_the_script_changes_directory(sd, monkeypatch):
    assert torch.equal(after_chdir(sd, monkeypatch), eager_image(sd))


def test_control_unanchored_the_first_use_looks_in_the_new_directory(sd, monkeypatch):
    monkeypatch.setattr(stageload.autostage, "_anchored", lambda values: values)
    with pytest.raises(OSError):
        after_chdir(sd, monkeypatch)


def after_default_dtype(sd: Path) -> torch.Tensor:
    """``torch.set_default_dtype(torch.float64)`` after ``from_pretrained``, before the use."""
    before = torch.get_default_dtype()
    try:
        with auto(budget=1):
            vae = diffusers.AutoencoderKL.from_pretrained(sd, subfolder="vae")
            torch.set_default_dtype(torch.float64)
            return decode(vae).to(before)
    finally:
        torch.set_default_dtype(before)


def test_the_default_dtype_set_after_the_factory_call_is_not_the_models(sd):
    """Eager built the VAE in float32 at the call; a float32 latent decodes as there."""
    assert torch.equal(after_default_dtype(sd), eager_image(sd))


def test_control_under_the_new_default_dtype_the_vae_is_built_in_float64(sd, monkeypatch):
    import contextlib

    monkeypatch.setattr(
        stageload.autostage, "_default_dtype", lambda dtype: contextlib.nullcontext()
    )
    with pytest.raises(RuntimeError, match="should be the same"):
        after_default_dtype(sd)


def test_a_class_named_as_a_factory_is_refused_with_the_way_out():
    """Wrapped, ``torch.nn.Linear`` became a function: ``isinstance`` and subclasses broke."""
    refused = pytest.raises(stageload.autostage.AutoError, match="is a class.*Linear.from_pre")
    with refused, auto(factories=["torch.nn:Linear"], defaults=False):
        pass
    assert isinstance(torch.nn.Linear(1, 1), torch.nn.Linear)


def overwritten_before_use(sd: Path, tmp_path: Path) -> torch.Tensor:
    """A VAE saved, loaded with ``from_pretrained``, then saved over with other weights
    (a training loop's ``output_dir``) before its first call."""
    vae = diffusers.AutoencoderKL.from_pretrained(sd, subfolder="vae")
    vae.save_pretrained(tmp_path / "vae")
    with auto(budget=1):
        mine = diffusers.AutoencoderKL.from_pretrained(tmp_path / "vae")
        with torch.no_grad():
            for p in vae.parameters():
                p.mul_(0.5)
        vae.save_pretrained(tmp_path / "vae")
        return decode(mine)


def test_files_replaced_before_the_first_use_raise_instead_of_giving_their_weights(sd, tmp_path):
    with pytest.raises(stageload.autostage.AutoError, match="before its first use"):
        overwritten_before_use(sd, tmp_path)


def test_control_unchecked_the_model_silently_gets_the_new_weights(sd, tmp_path, monkeypatch):
    monkeypatch.setattr(stageload.autostage, "changed_file", lambda stamps: None)
    assert not torch.equal(overwritten_before_use(sd, tmp_path), eager_image(sd))


def replaced_between_calls(sd: Path, tmp_path: Path) -> list[Any]:
    """The diffusers adapter (every component released between stages): the UNet's file
    replaced (``os.replace``, as a download does) with other weights after the first call.
    Returns the two outputs, or the second call's error."""
    import shutil

    from safetensors.torch import load_file, save_file

    from stageload.diffusers import staged_pipeline

    copy = tmp_path / "sd"
    shutil.copytree(sd, copy)
    pipe = staged_pipeline(FAMILIES["sd"].cls, copy, keep=())
    first = pipe(**FAMILIES["sd"].call(0))[0]
    (unet,) = (copy / "unet").glob("*.safetensors")
    tensors = {k: v * 0.5 for k, v in load_file(unet).items()}
    save_file(tensors, tmp_path / "new.safetensors", metadata={"format": "pt"})
    os.replace(tmp_path / "new.safetensors", unet)
    try:
        return [first, pipe(**FAMILIES["sd"].call(0))[0]]
    except ModelLoadError as exc:  # loading 'unet' for stage 'denoise' failed: the cause
        return [first, exc.__cause__]


def test_a_file_replaced_after_the_first_read_fails_the_reload_and_names_it(sd, tmp_path):
    """Eager keeps the weights it read: its second call equals its first. A reload from the
    new file would differ; it raises, naming the file and the way out."""
    _, err = replaced_between_calls(sd, tmp_path)
    assert isinstance(err, CheckpointError)
    assert "unet" in err.path and "replaced since" in str(err)
    assert "load the model again" in str(err)


def test_control_unchecked_the_reload_silently_gives_other_weights(sd, tmp_path, monkeypatch):
    monkeypatch.setattr("stageload.load.checkpoint.changed_file", lambda stamps: None)
    first, second = replaced_between_calls(sd, tmp_path)
    assert not torch.equal(first, second)


def interrupted_at(sd: Path, name: str) -> list[torch.Tensor]:
    """Tiny SD under auto with room for one component: one call, then a call interrupted
    (as a Ctrl-C, caught as a notebook does) where a reload from the files calls ``name``,
    then two calls. Returns those two calls' images."""
    import sys

    family = FAMILIES["sd"]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        back = frame.f_back
        if event == "call" and frame.f_code.co_name == name and back.f_code.co_name == "_fill":
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    with auto(budget=300_000):
        pipe = family.load(sd)
        pipe(**family.call(5))
        sys.settrace(tracer)
        try:
            pipe(**family.call(6))
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        return [pipe(**family.call(seed)).images for seed in (0, 1)]


@pytest.mark.parametrize("name", ["_settle", "_seen", "_samples", "_emit"])
def test_a_ctrl_c_as_a_reload_ends_leaves_the_next_calls_equal_to_eager(sd, name):
    """Found by a new-user helper: interrupted as it compared the reload with its samples,
    a model stayed loaded with the addresses of its previous load, and each later reload
    placed its tensors otherwise: every call after differed from eager's by 2e-7 to 3e-7."""
    family = FAMILIES["sd"]
    eager = family.load(sd)
    want = [eager(**family.call(seed)).images for seed in (0, 1)]
    got = interrupted_at(sd, name)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
