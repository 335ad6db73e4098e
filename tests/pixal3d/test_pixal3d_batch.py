"""Several images through the Pixal3D stub port, stage-major (``stageload-pixal3d a b c -o D/``):
each GLB equals its single-image run byte for byte, and each model loads as often as for one
image, whatever the number of images.

Reference: ``singles``, each image run alone with staged loading (not eager), in this
process; this process's default torch threads on both sides."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from fixtures.pixal3d_stub import write_image
from stageload import ListSink
from stageload.pixal3d import import_port, run
from stageload.pixal3d.batch import run_many
from stageload.pixal3d.cli import main

pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("inputs")
    return [write_image(root / f"{name}.png", i) for i, name in enumerate(["chair", "lamp"])]


@pytest.fixture(scope="module")
def singles(stub: Path, images: list[Path], tmp_path_factory: pytest.TempPathFactory):
    """Each image run alone (staged), its GLB bytes, fingerprints and load counts."""
    port = import_port(stub)
    out = tmp_path_factory.mktemp("singles")
    found = []
    for image in images:
        sink = ListSink()
        args = port.parse_args([str(image), "--output", str(out / f"{image.stem}.glb"), *CPU])
        result = run(port, args, events=sink)
        loads = Counter(e.model for e in sink.events if e.kind in ("load", "reload"))
        found.append((result.output.read_bytes(), result.fingerprints, loads))
    return found


CPU = ["--device", "cpu", "--seed", "7"]


def test_images_stage_major_equal_single_runs_with_the_loads_of_one(
    stub, images, singles, tmp_path
):
    port = import_port(stub)
    sink = ListSink()
    args = [
        port.parse_args([str(image), "--output", str(tmp_path / f"{image.stem}.glb"), *CPU])
        for image in images
    ]
    results = run_many(port, args, events=sink)
    for result, (glb, prints, _) in zip(results, singles, strict=True):
        assert result.output.read_bytes() == glb
        assert [r["sha256"] for r in result.fingerprints] == [r["sha256"] for r in prints]
        assert result.stages[-1] == "export"
    loads = Counter(e.model for e in sink.events if e.kind in ("load", "reload"))
    assert loads == singles[0][2]  # the loads of one image, for two
    assert len(loads) >= 7 and max(loads.values()) <= 2  # shape decoder: plan lists it twice
    stages = [e.stage for e in sink.kinds("stage")]
    assert stages == results[0].stages  # each stage entered once for all images


def test_images_stage_major_under_auto_equal_single_runs_with_the_reads_of_one(
    stub, images, singles, tmp_path
):
    """``load="auto"``: two different images, stage-major, with room for one stage's
    models (90.4 kB on the stub): each GLB and latent is its single run's, each stage is
    entered once, and each of the port's models is read once for both images."""
    from stageload.pixal3d.plan import MODEL_NAMES

    port = import_port(stub)

    def reads(sink: ListSink) -> Counter:
        kinds = ("load", "reload", "prefetch")
        return Counter(e.model for e in sink.events if e.kind in kinds and e.model in MODEL_NAMES)

    args = [
        port.parse_args([str(image), "--output", str(tmp_path / f"{image.stem}.glb"), *CPU])
        for image in images
    ]
    alone = ListSink()
    run(port, args[0], load="auto", events=alone, budget=100_000)
    sink = ListSink()
    results = run_many(port, args, load="auto", events=sink, budget=100_000)
    for result, (glb, prints, _) in zip(results, singles, strict=True):
        assert result.output.read_bytes() == glb
        assert [r["sha256"] for r in result.fingerprints] == [r["sha256"] for r in prints]
    assert [e.stage for e in sink.kinds("stage")] == results[0].stages
    # Each model once, as alone; the shape decoder, which the plan lists at shape_512 and
    # decode, twice (alone it stays loaded in between).
    assert reads(sink).keys() == reads(alone).keys()
    assert {m for m, n in reads(sink).items() if n > 1} <= {"shape_slat_decoder"}


def test_the_command_writes_one_glb_per_image_into_the_folder(stub, images, singles, tmp_path):
    out = tmp_path / "out"
    argv = [*map(str, images), "-o", f"{out}/", "--port", str(stub), *CPU]
    assert main([*argv, "--fingerprints", str(tmp_path / "fp")]) == 0
    for image, (glb, _, _) in zip(images, singles, strict=True):
        assert (out / f"{image.stem}.glb").read_bytes() == glb
        assert (tmp_path / "fp" / image.stem / "fingerprints.json").is_file()


@pytest.mark.parametrize("load", ["staged", "auto"])
def test_a_failing_image_is_named_and_the_others_are_written(stub, images, tmp_path, capsys, load):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    out = tmp_path / "out"
    argv = [str(images[0]), str(text), "-o", str(out), "--port", str(stub), *CPU]
    assert main([*argv, "--load", load]) == 1
    captured = capsys.readouterr()
    assert (out / f"{images[0].stem}.glb").is_file() and not (out / "notes.glb").exists()
    assert "image " in captured.err and "notes.png" in captured.err
    assert "Traceback" not in captured.err


def test_two_images_with_one_name_are_refused(stub, images, tmp_path, capsys):
    other = tmp_path / "again"
    other.mkdir()
    twin = other / images[0].name
    twin.write_bytes(images[0].read_bytes())
    argv = [str(images[0]), str(twin), "-o", str(tmp_path / "out"), "--port", str(stub), *CPU]
    assert main(argv) == 2
    assert "would both write" in capsys.readouterr().err
