"""``stageload-pixal3d --stream NAME`` on the stub port: a flow model read block by block.

The stub's flow models run a ``blocks`` ModuleList and compute a non-persistent
``pos_freqs`` buffer in ``__init__``, as the port's do. Streamed, the run's latents and GLB
equal the port's own (eager) loading byte for byte; the control streams a checkpoint with
one block weight changed and sees the latents change from that model's stage on.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fixtures.pixal3d_stub import port_args, write_image
from stageload import ListSink, StreamError
from stageload.pixal3d import Pixal3DRun, import_port, run
from stageload.pixal3d.cli import main

pytest.importorskip("PIL.Image")

SS, SHAPE_1024 = "sparse_structure_flow_model", "shape_slat_flow_model_1024"


@pytest.fixture(scope="module")
def eager(stub: Path, image: Path, tmp_path_factory: pytest.TempPathFactory):
    """The port's own loading: its GLB bytes and latent hashes."""
    port = import_port(stub)
    out = tmp_path_factory.mktemp("eager") / "eager.glb"
    result = run(port, port_args(port, image, out), load="eager")
    return out.read_bytes(), [r["sha256"] for r in result.fingerprints]


def test_streamed_flow_models_give_the_eager_glb_and_latents(stub, image, tmp_path, eager):
    """Reference: the port's own loading (``load_state_dict``; the stream places as it,
    ``COPIED``) in this process, same torch threads; GLB bytes and latent sha256."""
    port = import_port(stub)
    sink = ListSink()
    args = port_args(port, image, tmp_path / "streamed.glb")
    with Pixal3DRun(port, args, events=sink, stream=[SHAPE_1024, SS]) as staged:
        result = staged.execute()
        first = dict(staged._streams)
        stats = {name: s.stats for name, s in first.items()}
        resident = {name: s.resident() for name, s in first.items()}
        # A second image: each streamed model, released at its stage's end, is built anew
        # (the previous stream closed) and gives the same latents.
        again = staged.execute()
        assert all(staged._streams[n] is not first[n] for n in first)
        assert all(s._executor is None for s in first.values())
    glb, hashes = eager
    assert [r["sha256"] for r in again.fingerprints] == hashes
    assert [r["sha256"] for r in result.fingerprints] == hashes
    assert result.output.read_bytes() == glb
    # Each call reads every block: 4 steps x 2 calls (guidance) x 2 or 3 blocks.
    assert stats[SS].blocks_loaded == 16 and stats[SHAPE_1024].blocks_loaded == 24
    blocks = Counter(e.model for e in sink.kinds("block"))
    assert blocks == {SS: 32, SHAPE_1024: 48}  # over both images
    assert resident == {SS: [], SHAPE_1024: []}  # no block held after its forward
    # Loaded at its stage (the parts outside the blocks only) and released at its end.
    loads = {e.model: e for e in sink.events if e.kind == "load"}
    released = {e.model: e for e in sink.kinds("release")}
    assert loads[SHAPE_1024].stage == "shape_1024" and released[SHAPE_1024].stage == "texture"
    assert released[SHAPE_1024].bytes == loads[SHAPE_1024].bytes
    # Against the same class loaded whole (the 512 model differs only in resolution).
    assert loads[SHAPE_1024].bytes < loads["shape_slat_flow_model_512"].bytes / 5


def test_a_wrong_block_weight_in_the_streamed_checkpoint_changes_the_latents(
    stub, image, tmp_path, eager, monkeypatch
):
    """Control: the comparison above sees the streamed blocks' weights. One weight of one
    block changed changes shape_1024's latent and those after it, not those before."""
    from safetensors.torch import load_file, save_file

    recipe = Pixal3DRun._stream_recipe

    def altered(self: Pixal3DRun, name: str, placeholder: Any) -> Any:
        build, file = recipe(self, name, placeholder)
        tensors = load_file(file)
        tensors["blocks.1.fc1.weight"][0, 0] += 0.5
        changed = tmp_path / f"{name}.safetensors"
        save_file(tensors, changed)
        return build, changed

    monkeypatch.setattr(Pixal3DRun, "_stream_recipe", altered)
    port = import_port(stub)
    result = run(port, port_args(port, image, tmp_path / "o.glb"), stream=[SHAPE_1024])
    got, want = [r["sha256"] for r in result.fingerprints], eager[1]
    assert got[:2] == want[:2]  # structure, shape_512: before the streamed model
    assert got[2] != want[2] and got[3] != want[3]


def test_the_command_streams_names_given_repeated_or_with_commas(stub, image, tmp_path, eager):
    out, trace, prints = tmp_path / "o.glb", tmp_path / "t.jsonl", tmp_path / "fp"
    argv = [str(image), "-o", str(out), "--port", str(stub), "--device", "cpu", "--seed", "7"]
    argv += ["--trace", str(trace), "--interval", "0.2", "--fingerprints", str(prints)]
    assert main([*argv, "--stream", f"{SS},{SHAPE_1024}", "--stream", SS]) == 0
    assert out.read_bytes() == eager[0]
    written = json.loads((prints / "fingerprints.json").read_text())
    assert [r["sha256"] for r in written["latents"]] == eager[1]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["meta"]["stream"] == [SS, SHAPE_1024]
    blocks = Counter(r["model"] for r in records if r.get("kind") == "block")
    assert blocks == {SS: 16, SHAPE_1024: 24}


def test_an_unknown_name_is_refused_listing_the_models(stub, image, tmp_path, capsys):
    argv = [str(image), "-o", str(tmp_path / "o.glb"), "--port", str(stub), "--device", "cpu"]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--stream", "shape_slat_flow_model_2048"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "'shape_slat_flow_model_2048', which is not one of the pipeline's models" in err
    assert "models: sparse_structure_flow_model, sparse_structure_decoder" in err
    assert main([*argv, "--stream", SS, "--load", "eager"]) == 2
    assert "--stream needs --load staged or --load auto" in capsys.readouterr().err
    port = import_port(stub)
    with pytest.raises(ValueError, match="not one of the pipeline's models"):
        Pixal3DRun(port, port_args(port, image, tmp_path / "o.glb"), stream=["transformer"])
    with pytest.raises(TypeError, match="must list model names"):
        Pixal3DRun(port, port_args(port, image, tmp_path / "o.glb"), stream=SS)
    assert not (tmp_path / "o.glb").exists()


def test_a_model_without_a_block_list_is_refused_before_the_run(stub, image, tmp_path, capsys):
    port = import_port(stub)
    built = port.backbone_class.built
    with pytest.raises(StreamError, match="cannot stream 'sparse_structure_decoder'.*no nn"):
        Pixal3DRun(
            port, port_args(port, image, tmp_path / "o.glb"), stream=["sparse_structure_decoder"]
        )
    argv = [str(image), "-o", str(tmp_path / "o.glb"), "--port", str(stub), "--device", "cpu"]
    assert main([*argv, "--stream", "sparse_structure_decoder"]) == 1
    err = capsys.readouterr().err
    assert "cannot stream 'sparse_structure_decoder'" in err and "Traceback" not in err
    assert port.backbone_class.built == built  # nothing was loaded
    assert not (tmp_path / "o.glb").exists()


def test_two_images_stage_major_read_each_block_once_per_step(stub, image, tmp_path):
    """Under ``StagedModels.map`` (several images) the calls meet at each block: the two
    images read the blocks as often as one image does, and equal their unstreamed run.

    Reference: each image run alone with the port's own loading (unstreamed, staged), in
    this process, with the same torch threads on both sides."""
    from stageload.pixal3d.batch import run_many

    second = write_image(tmp_path / "second.png", seed=1)
    port = import_port(stub)

    def images(folder: str) -> list[Any]:
        (tmp_path / folder).mkdir()
        return [port_args(port, i, tmp_path / folder / f"{i.stem}.glb") for i in (image, second)]

    whole = run_many(port, images("whole"))
    sink = ListSink()
    streamed = run_many(port, images("streamed"), events=sink, stream=[SHAPE_1024, SS])
    for a, b in zip(whole, streamed, strict=True):
        assert b.output.read_bytes() == a.output.read_bytes()
        assert [r["sha256"] for r in b.fingerprints] == [r["sha256"] for r in a.fingerprints]
    assert Counter(e.model for e in sink.kinds("block")) == {SS: 16, SHAPE_1024: 24}
