"""``load="auto"`` (``stageload-pixal3d --load auto``): the port's own loading under
``stageload.auto``, the port's stages as auto's plan, the adapter's boundaries and
fingerprints. On the stub port (tests/fixtures/pixal3d_stub), as test_pixal3d.py.

Reference everywhere: the port's own loading (``load="eager"``) in this process, this
process's default torch threads on both sides.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from fixtures.pixal3d_stub import port_args
from stageload import ListSink
from stageload.pixal3d import PLAN_1024_CASCADE, import_port, run
from stageload.pixal3d.cli import main
from stageload.pixal3d.plan import MODEL_NAMES

pytest.importorskip("PIL.Image")

FLOW_MODELS = ("sparse_structure_flow_model", "shape_slat_flow_model_512")


@pytest.fixture(scope="module")
def eager(stub: Path, image: Path, tmp_path_factory: pytest.TempPathFactory):
    port = import_port(stub)
    out = tmp_path_factory.mktemp("eager") / "eager.glb"
    result = run(port, port_args(port, image, out), load="eager")
    return [r["sha256"] for r in result.fingerprints], out.read_bytes()


def test_auto_loading_writes_eagers_glb_and_releases_between_stages(stub, image, tmp_path, eager):
    """Room for no model (budget 1 B): every model the port's factories make is released
    after its use and reloaded at the next (the NAF upsampler too, from the port's
    ``_load_naf``), the latents and the GLB stay the port's own,
    and the trace's stages are the adapter's (auto's own, one per model, are left out)."""
    port = import_port(stub)
    sink = ListSink()
    result = run(
        port, port_args(port, image, tmp_path / "auto.glb"), load="auto", events=sink, budget=1
    )
    hashes, glb = eager
    assert [r["sha256"] for r in result.fingerprints] == hashes
    assert (tmp_path / "auto.glb").read_bytes() == glb
    stages = [e.stage for e in sink.events if e.kind == "stage"]
    assert stages == list(PLAN_1024_CASCADE)[1:]
    released = {e.model for e in sink.events if e.kind == "release"}
    assert {*FLOW_MODELS, "load_naf"} <= released  # the NAF upsampler: the port's _load_naf


def test_the_command_takes_load_auto(stub, image, tmp_path, eager, capsys):
    """``--load auto`` through the command: the port's stages seed auto's plan (said in
    the trace), and the GLB is the port's own."""
    trace = tmp_path / "auto.jsonl"
    out = tmp_path / "o.glb"
    argv = [str(image), "-o", str(out), "--port", str(stub), "--device", "cpu", "--seed", "7"]
    assert main([*argv, "--load", "auto", "--budget", "1", "--trace", str(trace)]) == 0
    assert "(auto loading)" in capsys.readouterr().out
    assert out.read_bytes() == eager[1]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["meta"]["load"] == "auto"
    events = [r for r in records if r["type"] == "event"]
    assert [e["stage"] for e in events if e["kind"] == "stage"] == list(PLAN_1024_CASCADE)[1:]
    notes = [e.get("note") or "" for e in events if e["kind"] == "note"]
    assert any(n.startswith("the plan before the first use") for n in notes)
    assert {e["model"] for e in events if e["kind"] == "release"} >= set(FLOW_MODELS)


@pytest.fixture(scope="module")
def renamed(stub: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stub with the shape_1024 flow model's checkpoint under another name than its
    key, as the real port's ``pipeline.json`` names its files
    (``ckpts/slat_flow_img2shape_dit_1_3B_1024_bf16``)."""
    port = tmp_path_factory.mktemp("renamed") / "Pixal3D-mac"
    shutil.copytree(stub, port)
    (config,) = port.rglob("pipeline.json")
    spec = json.loads(config.read_text())
    spec["args"]["models"]["shape_slat_flow_model_1024"] = "ckpts/slat_flow_img2shape_1024"
    config.write_text(json.dumps(spec))
    for suffix in (".json", ".safetensors"):
        old = config.parent / "ckpts" / f"shape_slat_flow_model_1024{suffix}"
        old.rename(old.with_name(f"slat_flow_img2shape_1024{suffix}"))
    return port


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "control"])
def test_load_auto_streams_a_model_block_by_block(renamed, image, tmp_path, eager, streamed):
    """``--load auto --stream``: the shape_1024 flow model (its file named otherwise than
    its key) is built streamed, never loaded whole, each call reads its blocks (4 steps x
    2 calls x 3 blocks), and the latents and GLB are the port's own. Control: without
    --stream it is one of auto's models, loaded whole, and no block is read."""
    name = "shape_slat_flow_model_1024"
    trace, out = tmp_path / "t.jsonl", tmp_path / "o.glb"
    argv = [str(image), "-o", str(out), "--port", str(renamed), "--device", "cpu"]
    argv += ["--seed", "7", "--load", "auto", "--budget", "1", "--trace", str(trace)]
    assert main([*argv, *(["--stream", name] if streamed else [])]) == 0
    assert out.read_bytes() == eager[1]
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    events = [e for e in events if e["type"] == "event"]
    blocks = sum(e["kind"] == "block" and e["model"] == name for e in events)
    whole = {e["model"] for e in events if e["kind"] in ("load", "reload") and e.get("note")}
    assert (blocks, "slat_flow_img2shape_1024" in whole) == ((24, False) if streamed else (0, True))


def test_three_images_stream_block_major_under_auto(stub, image, tmp_path, eager):
    """Three images stage-major, two models streamed: each GLB is the port's own, and
    each streamed model's blocks are read as often as for one image (block-major: every
    image's call of a block before the next block)."""
    from collections import Counter

    from stageload.pixal3d.batch import run_many

    port = import_port(stub)
    images = [port_args(port, image, tmp_path / f"{i}.glb") for i in range(3)]
    sink = ListSink()
    streamed = ["shape_slat_flow_model_1024", "sparse_structure_flow_model"]
    results = run_many(port, images, load="auto", events=sink, budget=1, stream=streamed)
    assert not [r for r in results if isinstance(r, Exception)]
    assert all((tmp_path / f"{i}.glb").read_bytes() == eager[1] for i in range(3))
    blocks = Counter(e.model for e in sink.events if e.kind == "block")
    assert blocks == {"shape_slat_flow_model_1024": 24, "sparse_structure_flow_model": 16}


def test_load_eager_refuses_stream(stub, image, tmp_path, capsys):
    argv = [str(image), "-o", str(tmp_path / "o.glb"), "--port", str(stub), "--device", "cpu"]
    assert main([*argv, "--load", "eager", "--stream", "shape_slat_flow_model_512"]) == 2
    assert "--stream needs --load staged or --load auto" in capsys.readouterr().err


@pytest.mark.parametrize("stand_in", [True, False], ids=["stand-in", "control"])
def test_the_ports_models_are_read_at_their_first_use_not_at_load_pipeline(
    stub, image, tmp_path, eager, stand_in, monkeypatch
):
    """The port's ``pixal3d.models.from_pretrained`` stands in (its model built from
    ``{path}.json`` on ``meta``): nothing of it is read before the run, the 512 texture
    model 1024_cascade never uses is never read, and the latents stay eager's. Control:
    without the stand-in, each model is read at ``load_pipeline``, before any stage."""
    import stageload.pixal3d.adapter as adapter

    if not stand_in:
        monkeypatch.setattr(adapter, "stand_in", lambda args, kwargs: None)
    port = import_port(stub)
    sink = ListSink()
    result = run(
        port, port_args(port, image, tmp_path / "o.glb"), load="auto", events=sink, budget=1
    )
    assert [r["sha256"] for r in result.fingerprints] == eager[0]
    first_stage = next(i for i, e in enumerate(sink.events) if e.kind == "stage")
    before = {e.model for e in sink.events[:first_stage] if e.kind in ("load", "reload")}
    ports = set(MODEL_NAMES)
    read = {e.model for e in sink.events if e.kind in ("load", "reload")}
    if stand_in:
        assert not before & ports
        assert "tex_slat_flow_model_512" not in read
    else:
        assert before & ports == ports


#: Room for the largest stage's models (shape_512's flow model and decoder, the DINOv3
#: backbone and the NAF upsampler: 90.4 kB on the stub), not for two stages'.
ONE_STAGE = 100_000


@pytest.mark.parametrize("stage_major", [True, False], ids=["stage-major", "control"])
def test_three_images_read_each_model_once_under_auto_as_staged(
    stub, image, tmp_path, eager, stage_major, monkeypatch
):
    """The figures in docs/pixal3d.md: reads of ``pipeline.models``' eight models for
    three images. Staged runs them stage-major: 8 reads (the shape decoder twice), as one
    image. ``load="auto"`` runs them stage-major too: with room for one stage's models, 8
    reads; with no budget (hard stages, as staged), 8; with room for all (``"auto"``: the
    memory available), 7 in all (the shape decoder stays); with room for none, 8 per
    image. Every GLB is the port's own. Control: the images one after the other, as
    before, read the models again per image with room for one stage: 15."""
    from stageload.pixal3d import batch

    if not stage_major:
        monkeypatch.setattr(
            batch.BatchRun, "execute_many", lambda run, images: [run._one(a) for a in images]
        )
    port = import_port(stub)
    images = [port_args(port, image, tmp_path / f"{i}.glb") for i in range(3)]

    def reads(load: str, **options: object) -> int:
        sink = ListSink()
        results = batch.run_many(port, images, load=load, events=sink, **options)
        assert not [r for r in results if isinstance(r, Exception)]
        assert all((tmp_path / f"{i}.glb").read_bytes() == eager[1] for i in range(3))
        kinds = ("load", "reload", "prefetch")
        return sum(e.kind in kinds and e.model in MODEL_NAMES for e in sink.events)

    assert reads("auto", budget=ONE_STAGE) == (8 if stage_major else 15)
    if stage_major:
        three = (
            reads("staged"),
            reads("auto", budget=1),
            reads("auto"),
            reads("auto", budget="auto"),
        )
        assert three == (8, 24, 8, 7)
        del images[1:]  # one image: the table's first column
        one = (reads("auto", budget=ONE_STAGE), reads("auto", budget=1), reads("auto"))
        assert (*one, reads("auto", budget="auto")) == (7, 8, 8, 7)


@pytest.mark.parametrize("budget", [None, "auto"], ids=["hard-stages", "control"])
def test_with_no_budget_each_stage_releases_what_it_does_not_use(
    stub, image, tmp_path, eager, budget
):
    """``--load auto`` with no ``--budget`` has the staged build's hard stages: entering a
    stage releases every model it does not use (reason ``not in plan``), so the export
    step, which lists none, runs with no model loaded. Control: a budget of the memory
    available keeps them all loaded through the export."""
    port = import_port(stub)
    sink = ListSink()
    out = tmp_path / "o.glb"
    run(port, port_args(port, image, out), load="auto", events=sink, budget=budget)
    assert out.read_bytes() == eager[1]
    export = next(i for i, e in enumerate(sink.events) if e.kind == "stage" and e.stage == "export")
    loaded: dict[str, bool] = {}
    for event in sink.events[:export]:
        if event.kind in ("load", "reload", "prefetch", "release"):
            loaded[event.model] = event.kind != "release"
    held = {name for name, is_loaded in loaded.items() if is_loaded}
    released = {
        e.model for e in sink.events[export:] if (e.kind, e.reason) == ("release", "not in plan")
    }
    assert held, "a model was loaded when the export began"
    # MoGe, made anew per image and dropped, goes whenever the garbage collector frees it:
    # during the export too (seen in CI), which is the script's doing, not a stage's.
    assert not [
        e
        for e in sink.events[export:]
        if e.kind == "release" and e.reason not in ("not in plan", "close", "dropped by the script")
    ]
    if budget is None:
        assert released == held
        reasons = {e.reason for e in sink.events if e.kind == "release"}
        assert reasons <= {"not in plan", "close", "dropped by the script"}  # MoGe: dropped
    else:
        assert not released


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "control"])
def test_the_background_remover_is_staged_under_auto(
    stub, image, tmp_path, eager, staged, monkeypatch
):
    """The port builds its background remover by a class call (a plain object holding a
    network), which no factory makes: ``--load auto`` hands the network to auto, so it is
    released once the preprocess stage is over; two images stage-major use it once, and
    image after image the second builds it again by the port's class (a reload). Every
    GLB is the port's own. Control: left to the port, it is never released."""
    import stageload.pixal3d.adapter as adapter
    from stageload.pixal3d import batch

    if not staged:
        monkeypatch.setattr(adapter.Pixal3DRun, "_stage_remover", lambda *a: None)
    port = import_port(stub)
    images = [port_args(port, image, tmp_path / f"{i}.glb") for i in range(2)]

    def remover_events() -> list[str]:
        sink = ListSink()
        results = batch.run_many(port, images, load="auto", events=sink)
        assert not [r for r in results if isinstance(r, Exception)]
        assert all((tmp_path / f"{i}.glb").read_bytes() == eager[1] for i in range(2))
        return [e.kind for e in sink.events if e.model == "rembg_model" and e.kind != "note"]

    stage_major = remover_events()
    monkeypatch.setattr(
        batch.BatchRun, "execute_many", lambda run, images: [run._one(a) for a in images]
    )
    one_by_one = remover_events()
    if staged:
        assert stage_major == ["load", "release"]
        assert one_by_one == ["load", "release", "reload", "release"]
    else:
        assert stage_major == one_by_one == []


def test_prefetch_under_auto_needs_a_budget(stub, image, tmp_path, capsys):
    """With no budget each stage releases what it does not use, so a load ahead loaded
    models no stage was in (helper-54: 11 reads for three images, not 8, and the export
    began with models loaded): refused, from the command and from Python."""
    from stageload.pixal3d import Pixal3DRun

    argv = [str(image), "-o", str(tmp_path / "o.glb"), "--port", str(stub), "--device", "cpu"]
    assert main([*argv, "--load", "auto", "--prefetch"]) == 2
    assert "--prefetch needs --budget" in capsys.readouterr().err
    port = import_port(stub)
    with pytest.raises(ValueError, match="needs a budget"):
        Pixal3DRun(port, port_args(port, image, tmp_path / "o.glb"), load="auto", prefetch=True)
    assert main([*argv, "--load", "auto", "--prefetch", "--budget", "auto"]) == 0


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "control"])
def test_closing_an_auto_run_releases_its_models(stub, image, tmp_path, closed, monkeypatch):
    """A run stopped after the structure stage, then closed: every model auto loaded for
    it is released (reason ``close``), as the staged build's close does; from Python, the
    next run started beside the last one's weights (helper-54). Control: the block's end
    alone leaves them loaded."""
    import stageload.pixal3d.adapter as adapter

    if not closed:
        monkeypatch.setattr(adapter.StageMajor, "close", lambda self: None)
    port = import_port(stub)
    sink = ListSink()
    args = port_args(port, image, tmp_path / "o.glb")
    with adapter.Pixal3DRun(port, args, load="auto", events=sink, stop_after="structure") as r:
        r.execute()
        end = len(sink.events)
    held = set()
    for event in sink.events[:end]:
        if event.kind in ("load", "reload", "prefetch"):
            held.add(event.model)
        elif event.kind == "release":
            held.discard(event.model)
    assert "sparse_structure_flow_model" in held
    released = {e.model for e in sink.events[end:] if e.kind == "release"}
    assert released == (held if closed else set())
    assert {e.reason for e in sink.events[end:] if e.kind == "release"} <= {"close"}


@pytest.mark.parametrize("one", [True, False], ids=["one-at-a-time", "control"])
def test_a_second_open_run_is_refused(stub, image, tmp_path, one, monkeypatch):
    """The port keeps its state in globals, so two open runs gave wrong GLBs or crashed
    (two threads, helper-54): a second one is refused while the first is open, and
    allowed once it is closed. Control: without the one-run lock, the second opens."""
    import stageload.pixal3d.adapter as adapter

    class Free:  # a lock that any number of runs holds
        def acquire(self, blocking: bool = True) -> bool:
            return True

        def release(self) -> None:
            pass

    if not one:
        monkeypatch.setattr(adapter, "_LIVE", Free())
    port = import_port(stub)
    args = port_args(port, image, tmp_path / "o.glb")
    with adapter.Pixal3DRun(port, args, load="auto"):
        if one:
            with pytest.raises(RuntimeError, match="another Pixal3D run is open"):
                adapter.Pixal3DRun(port, args, load="eager")
        else:
            adapter.Pixal3DRun(port, args, load="eager").close()

    def fails(self: Any) -> None:
        raise RuntimeError("the port's API differs")

    with monkeypatch.context() as m:  # a constructor that fails gives the run back too
        m.setattr(adapter.Pixal3DRun, "_attach", fails)
        with pytest.raises(RuntimeError, match="API differs"):
            adapter.Pixal3DRun(port, args, load="auto")
    with adapter.Pixal3DRun(port, args, load="eager") as again:
        assert again.execute().output is not None


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "control"])
def test_parts_loaded_at_setup_wait_for_their_stage_under_hard_stages(
    stub, image, tmp_path, eager, kept, monkeypatch
):
    """The stub's DINOv3 backbone and NAF upsampler are made (loaded) by their factories at
    ``load_pipeline``, before any stage: with no budget, the stages before theirs keep them
    (never called yet, a later stage lists them), so each is read once, as staged (they
    were released at preprocess and read again at structure, helper-54). The GLB is the
    port's own. Control: without the later stages' list, each is read twice."""
    from stageload.autostage import AutoSession

    if not kept:
        real = AutoSession.release_unlisted
        monkeypatch.setattr(
            AutoSession, "release_unlisted", lambda self, objects, **k: real(self, objects)
        )
    port = import_port(stub)
    sink = ListSink()
    out = tmp_path / "o.glb"
    run(port, port_args(port, image, out), load="auto", events=sink)
    assert out.read_bytes() == eager[1]
    kinds = ("load", "reload", "prefetch")
    reads = [
        e.model for e in sink.events if e.kind in kinds and e.model in ("dinov3-tiny", "load_naf")
    ]
    assert sorted(reads) == sorted(["dinov3-tiny", "load_naf"] * (1 if kept else 2))


@pytest.mark.parametrize("control", [False, True], ids=["listening", "control-always"])
def test_a_batch_with_no_sink_makes_no_held_bytes_walk(
    stub, image, tmp_path, eager, monkeypatch, control
):
    """The batch's note of what parked calls hold walks every object gc tracks (0.1 s a
    stage): with no sink and no outer trace the adapter says no one listens, and the batch
    makes no walk; with a sink it does. The GLBs are the port's either way. Control: a
    StageMajor that assumes the adapter's emit listens walks as often with no sink."""
    from stageload.autostage import StageMajor
    from stageload.core import batch as batch_module
    from stageload.pixal3d.batch import run_many

    monkeypatch.delenv("STAGELOAD_TRACE", raising=False)
    if control:
        monkeypatch.setattr(StageMajor, "listening", lambda self: True)
    walks = []
    walk = batch_module._live_storage_sizes
    monkeypatch.setattr(batch_module, "_live_storage_sizes", lambda: walks.append(1) or walk())
    port = import_port(stub)
    images = [port_args(port, image, tmp_path / f"{i}.glb") for i in range(2)]
    counts = []
    for sink in (None, ListSink()):
        walks.clear()
        results = run_many(port, images, load="auto", events=sink)
        assert not [r for r in results if isinstance(r, Exception)]
        assert all((tmp_path / f"{i}.glb").read_bytes() == eager[1] for i in range(2))
        counts.append(len(walks))
    assert counts[1] > 0
    assert counts[0] == 0 if not control else counts[0] == counts[1], counts
