"""stageload.pixal3d on a stub of the Pixal3D-mac port (tests/fixtures/pixal3d_stub).

The stub has tiny real models and the port's names, call order, seeding and noise draws;
it is installed on a temp path, as a user's checkout would be. Nothing here ran the real
port: that needs an Apple Silicon Mac and its weights.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.pixal3d_stub import install_stub, port_args
from stageload import ReleasedModuleError, on_call
from stageload.pixal3d import (
    PLAN_1024_CASCADE,
    PORT_ENV,
    Pixal3DRun,
    PortError,
    UnsupportedPipelineError,
    find_port,
    import_port,
    run,
)
from stageload.pixal3d.cli import main

pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def eager_hashes(stub: Path, image: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    port = import_port(stub)
    out = tmp_path_factory.mktemp("eager") / "eager.glb"
    result = run(port, port_args(port, image, out), load="eager")
    assert [r["stage"] for r in result.fingerprints] == [
        "structure",
        "shape_512",
        "shape_1024",
        "texture",
    ]
    return [r["sha256"] for r in result.fingerprints]


def test_staged_fingerprints_equal_eager(stub, image, tmp_path, eager_hashes):
    """Reference: eager, ``run(load="eager")``: the port's own ``load_pipeline`` (its
    ``from_pretrained``), in this process; this process's default torch threads on both
    sides. Compared: the sha256 of the four latents."""
    port = import_port(stub)
    result = run(port, port_args(port, image, tmp_path / "staged.glb"), load="staged")
    assert [r["sha256"] for r in result.fingerprints] == eager_hashes
    assert result.stages == list(PLAN_1024_CASCADE)[1:]  # setup is the time before the first


def test_without_rng_preservation_fingerprints_differ_from_the_first_latent_on(
    stub, image, tmp_path, eager_hashes
):
    """Control: lazy loads inside the seeded run shift the noise unless the RNG is restored,
    and the first model is fetched before the first draw."""
    port = import_port(stub)
    args = port_args(port, image, tmp_path / "off.glb")
    result = run(port, args, load="staged", preserve_rng=False)
    hashes = [r["sha256"] for r in result.fingerprints]
    assert len(hashes) == 4
    assert all(a != b for a, b in zip(hashes, eager_hashes, strict=True))


class Snapshots:
    """An event sink that records what StagedModels holds at each load and stage end."""

    def __init__(self) -> None:
        self.models = None
        self.previous: str | None = None
        self.at_load: list[tuple[str, str, set[str]]] = []
        self.at_end: dict[str, set[str]] = {}
        self.notes: list[str] = []
        self.events = []

    def emit(self, event) -> None:  # noqa: ANN001
        self.events.append(event)
        if event.kind == "note":
            self.notes.append(event.note)
        elif event.kind in ("load", "reload"):
            self.at_load.append((self.models.stage, event.model, set(self.models.loaded())))
        elif event.kind == "stage":
            # Emitted before the releases: what is loaded now is what the last stage held.
            if self.previous is not None:
                self.at_end[self.previous] = set(self.models.loaded())
            self.previous = event.stage


def test_each_stage_holds_only_its_planned_models(stub, image, tmp_path):
    port = import_port(stub)
    sink = Snapshots()
    with Pixal3DRun(port, port_args(port, image, tmp_path / "o.glb"), events=sink) as staged:
        sink.models = staged.models
        assert staged.models.loaded() == []  # the pipeline was built without weights
        assert staged.pipeline.low_vram is False
        staged.execute()
        sink.at_end[sink.previous] = set(staged.models.loaded())
    assert sink.notes == []  # nothing was used outside its stage
    for stage, model, loaded in sink.at_load:
        assert loaded <= set(PLAN_1024_CASCADE[stage]), (stage, model, loaded)
    shared = {"image_cond_backbone", "image_cond_naf"}
    assert sink.at_end == {
        "preprocess": {"rembg_model"},
        "camera": set(),
        "structure": {
            "sparse_structure_flow_model",
            "sparse_structure_decoder",
            "image_cond_model_ss",
            "image_cond_backbone",  # the ss extractor has no NAF
        },
        "shape_512": {
            "shape_slat_flow_model_512",
            "shape_slat_decoder",
            "image_cond_model_shape_512",
        }
        | shared,
        "shape_1024": {"shape_slat_flow_model_1024", "image_cond_model_shape_1024"} | shared,
        "texture": {"tex_slat_flow_model_1024", "image_cond_model_tex_1024"} | shared,
        "decode": {"shape_slat_decoder", "tex_slat_decoder"},
        "export": set(),
    }
    loads = [(e.kind, e.model) for e in sink.events if e.kind in ("load", "reload")]
    assert ("reload", "shape_slat_decoder") in loads  # needed again to decode
    assert "tex_slat_flow_model_512" not in {m for _, m in loads}  # 1536_cascade only
    released = {e.model: e.bytes for e in sink.events if e.kind == "release"}
    assert released["image_cond_backbone"] > 0  # freed once, by its own entry
    # The shared backbone and NAF count once in the loads too: every byte loaded is
    # released exactly once by the end of the run.
    loaded_bytes = sum(e.bytes for e in sink.events if e.kind in ("load", "reload"))
    assert loaded_bytes == sum(e.bytes for e in sink.events if e.kind == "release")


def test_backbone_and_naf_are_built_once(stub, image, tmp_path):
    port = import_port(stub)
    backbone, naf = port.backbone_class, port.generate.NAFUpsampler
    before = (backbone.built, naf.built)
    run(port, port_args(port, image, tmp_path / "eager.glb"), load="eager")
    eager = (backbone.built - before[0], naf.built - before[1])
    before = (backbone.built, naf.built)
    run(port, port_args(port, image, tmp_path / "staged.glb"), load="staged")
    staged = (backbone.built - before[0], naf.built - before[1])
    assert eager == (4, 3)  # the port's own loading: one per extractor
    assert staged == (1, 1)


def test_a_released_model_raises_the_clear_error(stub, image, tmp_path):
    port = import_port(stub)
    kept = []
    with Pixal3DRun(port, port_args(port, image, tmp_path / "o.glb")) as staged:
        pipeline = staged.pipeline
        # Wrapped after the adapter's hook, so it runs first: texture's model is still loaded.
        on_call(
            pipeline,
            "decode_latent",
            before=lambda *a, **k: kept.append(pipeline.models["tex_slat_flow_model_1024"]),
        )
        staged.execute()
    (model,) = kept
    with pytest.raises(ReleasedModuleError, match="tex_slat_flow_model_1024.*'decode'") as info:
        model(None, None, None)
    assert (info.value.name, info.value.stage) == ("tex_slat_flow_model_1024", "decode")
    assert all(p.is_meta for p in model.parameters())


def test_a_missing_port_gives_the_clear_error(tmp_path, monkeypatch, image, capsys):
    monkeypatch.delenv(PORT_ENV, raising=False)
    with pytest.raises(PortError, match=f"pass --port DIR or set {PORT_ENV}"):
        find_port(None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PortError, match="has no generate_mps.py and no pixal3d"):
        find_port(tmp_path / "empty")
    assert (
        main([str(image), "-o", str(tmp_path / "o.glb"), "--port", str(tmp_path / "nowhere")]) == 2
    )
    err = capsys.readouterr().err
    assert "is not a folder" in err and "nowhere" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_port_with_another_api_gives_the_clear_error(tmp_path, image, capsys):
    broken = install_stub(tmp_path / "old-port", checkpoints=False)
    pipeline_py = broken / "pixal3d" / "pipelines" / "pixal3d_image_to_3d.py"
    pipeline_py.write_text(
        pipeline_py.read_text().replace("def get_proj_cond_shape(", "def proj_cond(")
    )
    script = broken / "generate_mps.py"
    script.write_text(script.read_text().replace("def _load_naf(", "def load_naf("))
    with pytest.raises(PortError) as info:
        import_port(broken)
    message = str(info.value)
    assert "generate_mps._load_naf" in message
    assert "Pixal3DImageTo3DPipeline.get_proj_cond_shape" in message
    assert "0be9e69" in message
    code = main(
        [str(image), "-o", str(tmp_path / "o.glb"), "--port", str(broken), "--device", "cpu"]
    )
    assert code == 2
    assert "does not have the API" in capsys.readouterr().err


def test_1536_cascade_is_refused_before_anything_loads(stub, image, tmp_path, capsys):
    port = import_port(stub)
    built = port.backbone_class.built
    args = port_args(port, image, tmp_path / "o.glb", "--pipeline-type", "1536_cascade")
    with pytest.raises(UnsupportedPipelineError, match="'1536_cascade' has no stage plan"):
        Pixal3DRun(port, args)
    assert port.backbone_class.built == built
    argv = [str(image), "-o", str(tmp_path / "o.glb"), "--port", str(stub), "--device", "cpu"]
    assert main([*argv, "--pipeline-type", "1536_cascade"]) == 2
    assert "supported: 1024_cascade" in capsys.readouterr().err
    assert not (tmp_path / "o.glb").exists()


def test_the_command_writes_its_output_and_a_trace(
    stub, image, tmp_path, monkeypatch, eager_hashes
):
    monkeypatch.setenv(PORT_ENV, str(stub))  # the port from the environment this time
    out, trace, prints = tmp_path / "object.glb", tmp_path / "run.jsonl", tmp_path / "fp"
    argv = [str(image), "-o", str(out), "--trace", str(trace), "--fingerprints", str(prints)]
    assert main([*argv, "--seed", "7", "--device", "cpu", "--interval", "0.05"]) == 0
    magic, version, length = struct.unpack("<4sII", out.read_bytes()[:12])
    assert (magic, version, length) == (b"glTF", 2, out.stat().st_size)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["type"] == "start" and records[-1]["type"] == "end"
    assert records[0]["meta"]["load"] == "staged"
    stages = [r["stage"] for r in records if r["type"] == "event" and r["kind"] == "stage"]
    assert stages == list(PLAN_1024_CASCADE)[1:]
    loads = [r["model"] for r in records if r["type"] == "event" and r["kind"] == "load"]
    assert "sparse_structure_flow_model" in loads and "image_cond_backbone" in loads
    assert any(r["type"] == "sample" for r in records)
    written = json.loads((prints / "fingerprints.json").read_text())
    assert [r["sha256"] for r in written["latents"]] == eager_hashes
    assert torch.load(prints / "00-structure.pt")["samples"].shape == (1, 4, 8, 8, 8)


def test_stop_after_ends_the_run_at_that_stage(stub, image, tmp_path, capsys):
    out = tmp_path / "o.glb"
    argv = [str(image), "-o", str(out), "--port", str(stub), "--device", "cpu", "--seed", "7"]
    assert main([*argv, "--stop-after", "shape_512", "--fingerprints", str(tmp_path / "fp")]) == 0
    assert not out.exists()
    assert "stopped after stage 'shape_512'" in capsys.readouterr().out
    written = json.loads((tmp_path / "fp" / "fingerprints.json").read_text())
    assert [r["stage"] for r in written["latents"]] == ["structure", "shape_512"]
    assert written["stopped_after"] == "shape_512"


def test_importing_the_command_does_not_import_torch():
    code = "import sys, stageload.pixal3d.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_build_on_device_falls_back_to_the_cpu_when_the_constructor_needs_it():
    """'meta' stands in for a GPU here: a real device type that this machine always has."""
    from stageload.pixal3d._parts import build_on_device

    seen = []

    def build():  # noqa: ANN202
        seen.append(torch.get_default_device().type)
        if seen[-1] != "cpu":
            raise RuntimeError("this constructor needs the CPU")
        return torch.nn.Linear(2, 2)

    model, why = build_on_device(build, "meta")
    assert seen == ["meta", "cpu"]  # tried on the device first
    assert model.weight.is_meta  # then built on the CPU and moved
    assert why == "RuntimeError: this constructor needs the CPU"
    seen.clear()
    model, why = build_on_device(build, "meta", on_device=False)
    assert (seen, why, model.weight.is_meta) == (["cpu"], None, True)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--trace", "t.jsonl", "--interval", "-1"], "duration must not be negative, got '-1'"),
        (["--trace", "t.jsonl", "--interval", "0"], "interval must be more than 0 seconds"),
        (["--trace", "."], "--trace '.': '.' is a folder"),
        (["--trace", "no/such/dir/t.jsonl"], "folder 'no/such/dir' does not exist"),
        (["--fingerprints", "a-file"], "--fingerprints 'a-file': 'a-file' is a file"),
    ],
)
def test_bad_paths_and_values_fail_before_the_run(
    stub, image, tmp_path, monkeypatch, capsys, extra, message
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    built = import_port(stub).backbone_class.built
    argv = [str(image), "-o", "o.glb", "--port", str(stub), "--device", "cpu", *extra]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("stageload-pixal3d: error: ")
    assert import_port(stub).backbone_class.built == built  # nothing was loaded
    assert not (tmp_path / "t.jsonl").exists()


def test_an_output_that_is_a_folder_is_refused(stub, image, tmp_path, capsys):
    argv = [str(image), "-o", str(tmp_path), "--port", str(stub), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--output {str(tmp_path)!r}: {str(tmp_path)!r} is a folder" in err
    assert "Traceback" not in err


def test_an_input_that_is_not_an_image_fails_in_one_line(stub, tmp_path, capsys):
    """The port's own image reader raises; the command says so without a traceback."""
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    argv = [str(text), "-o", str(tmp_path / "o.glb"), "--port", str(stub), "--device", "cpu"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("stageload-pixal3d: error: the run failed: ") and "notes.png" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_each_loader_works_alone_in_any_order_and_again(stub, image, tmp_path):
    """A residency policy may load in any order: the shared backbone and NAF load on their
    own, an extractor loads without its shared parts (and without loading them as
    entries), and the background remover loads again after a release."""
    port = import_port(stub)
    built = port.backbone_class.built
    with Pixal3DRun(port, port_args(port, image, tmp_path / "o.glb")) as staged:
        models = staged.models
        backbone = models["image_cond_backbone"]  # before any extractor
        naf = models["image_cond_naf"]
        extractor = models["image_cond_model_tex_1024"]
        assert extractor.model is backbone and extractor.upsampler is naf  # shared
        assert port.backbone_class.built == built + 1
        models.close()
        assert models["image_cond_model_shape_512"] is not None
        assert models.loaded() == ["image_cond_model_shape_512"]  # loaded nothing else
        assert not models["image_cond_model_shape_512"].model.patch_embed.weight.is_meta
        for _ in range(2):  # the remover again after its release
            remover = models["rembg_model"]
            assert not next(remover.parameters()).is_meta
            models.evict("rembg_model")


def test_a_run_processes_a_second_image(stub, image, tmp_path, eager_hashes):
    """``execute()`` again on the same run: its stages and latents are the second run's
    alone (they were both runs', 16 stages and 8 latents, helper-54), equal to eager's."""
    port = import_port(stub)
    with Pixal3DRun(port, port_args(port, image, tmp_path / "o.glb")) as staged:
        first = staged.execute()
        second = staged.execute()
    assert [r["sha256"] for r in first.fingerprints] == eager_hashes
    assert [r["sha256"] for r in second.fingerprints] == eager_hashes
    assert second.stages == first.stages and len(first.stages) == 8


# -- residency: --budget and --prefetch (docs/residency.md) ---------------------------------


def _events(trace: Path) -> list[dict]:
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return [r for r in records if r["type"] == "event"]


def test_budget_and_prefetch_keep_the_latents_and_load_each_model_once(
    stub, image, tmp_path, eager_hashes
):
    """Reference: ``eager_hashes`` (the port's own loading), in this process; this process's
    default torch threads on both sides."""
    trace, prints = tmp_path / "budget.jsonl", tmp_path / "fp"
    argv = [str(image), "-o", str(tmp_path / "o.glb"), "--port", str(stub), "--device", "cpu"]
    argv += ["--seed", "7", "--trace", str(trace), "--fingerprints", str(prints)]
    assert main([*argv, "--interval", "0.2", "--budget", "1G", "--prefetch"]) == 0
    written = json.loads((prints / "fingerprints.json").read_text())
    assert [r["sha256"] for r in written["latents"]] == eager_hashes
    events = _events(trace)
    # A budget that holds every model: nothing is released before the end, and nothing
    # loads twice.
    assert {e.get("reason") for e in events if e["kind"] == "release"} == {"close"}
    loaded = [e["model"] for e in events if e["kind"] in ("load", "reload", "prefetch")]
    assert len(loaded) == len(set(loaded)) and "sparse_structure_flow_model" in loaded


def test_bad_residency_flags_fail_in_one_line(stub, image, tmp_path, capsys):
    argv = [str(image), "-o", str(tmp_path / "o.glb"), "--port", str(stub), "--device", "cpu"]
    assert main([*argv, "--prefetch"]) == 2
    assert "--prefetch needs --budget" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([*argv, "--budget", "lots"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid budget 'lots'" in err and "Traceback" not in err
    assert not (tmp_path / "o.glb").exists()


@pytest.mark.parametrize("dropped", [True, False], ids=["dropped", "control"])
def test_a_remover_never_used_is_dropped_after_the_preprocess_stage(
    stub, tmp_path, dropped, monkeypatch
):
    """An image with its own alpha never calls the background remover, so the staged build
    never loads (and never releases) the one the port built: it is dropped once the
    preprocess stage is over, as a released one is (it stayed for the whole run,
    helper-54). Control: kept by the run, it lives to the end."""
    import gc
    import weakref

    import numpy as np
    from PIL import Image

    import stageload.pixal3d.adapter as adapter

    if not dropped:
        real = adapter.Pixal3DRun.enter

        def keeping(self, stage):
            kept = self._rembg
            real(self, stage)
            self._rembg = kept

        monkeypatch.setattr(adapter.Pixal3DRun, "enter", keeping)
    pixels = np.random.default_rng(0).integers(0, 256, (48, 48, 4), dtype=np.uint8)
    pixels[..., 3] = 0
    pixels[8:40, 8:40, 3] = 255  # an object on a transparent background
    Image.fromarray(pixels, "RGBA").save(tmp_path / "cut.png")
    port = import_port(stub)
    args = port_args(port, tmp_path / "cut.png", tmp_path / "o.glb")
    with adapter.Pixal3DRun(port, args, stop_after="structure") as staged:
        remover = weakref.ref(staged._rembg)
        staged.execute()
        gc.collect()
        assert (remover() is None) == dropped


def test_the_command_ends_by_sigint_on_ctrl_c_in_one_line(stub, image, tmp_path):
    """A Ctrl-C (a real SIGINT, at the structure stage) ends ``stageload-pixal3d`` by the
    signal, as python ends, with one line on stderr and no traceback (the port's was 15 to
    100 lines, helper-54). Control: ``main`` alone lets the traceback out."""
    script = f"""
import signal, sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import stageload.pixal3d.adapter as adapter
from stageload.pixal3d import cli
real = adapter.Pixal3DRun.enter
def enter(self, stage):
    if stage == "structure":
        signal.raise_signal(signal.SIGINT)
    return real(self, stage)
adapter.Pixal3DRun.enter = enter
sys.argv = ["stageload-pixal3d", {str(image)!r}, "-o", {str(tmp_path / "o.glb")!r},
            "--port", {str(stub)!r}, "--device", "cpu"]
cli.entry() if sys.argv and "{{how}}" == "entry" else sys.exit(cli.main())
"""
    runs = {}
    for how in ("entry", "main"):
        done = subprocess.run(
            [sys.executable, "-c", script.replace("{how}", how)],
            capture_output=True,
            text=True,
            timeout=240,
        )
        runs[how] = done
    assert runs["entry"].returncode == -2
    assert runs["entry"].stderr.strip().splitlines()[-1:] == ["stageload-pixal3d: interrupted"]
    assert "Traceback" not in runs["entry"].stderr
    assert "Traceback" in runs["main"].stderr  # control
