"""The demo end to end (small size, real subprocesses and meters), and its parts."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from stageload.cli import main
from stageload.demo import (
    MODELS,
    SIZES,
    compare_outputs,
    ensure_weights,
    make_models,
    run_pipeline,
    weights_dir,
)
from stageload.demo.pipeline import weights_valid

torch = pytest.importorskip("torch")
SMALL = SIZES["small"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> tuple[int, Path, str, str]:
    """One full ``stageload demo --size small --json`` run, shared by the tests below."""
    out = tmp_path_factory.mktemp("demo")
    # capsys is function-scoped, so the module-scoped run captures its own output.
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(
            ["demo", "--size", "small", "-o", str(out), "--cache", str(cache), "--json",
             "--interval", "0.05"]
        )  # fmt: skip
    return code, out, stdout.getvalue(), stderr.getvalue()


def test_demo_runs_end_to_end_with_identical_outputs(demo) -> None:
    """Reference: the demo's eager run, the same ``load_model`` loaders (a model built, then
    its weights copied from ``safe_open``) called up front and kept, in its own process.
    Threads: the demo pins torch to min(2, CPUs) in both processes (``set_num_threads`` and
    ``OMP_NUM_THREADS``)."""
    code, out, stdout, stderr = demo
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["identical"] is True and result["max_abs_diff"] == 0.0
    for name in ("eager.jsonl", "staged.jsonl", "eager-output.safetensors",
                 "staged-output.safetensors", "demo.json"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    assert (out / "demo.png").read_bytes()[:8] == PNG_SIGNATURE
    assert json.loads((out / "demo.json").read_text()) == result
    # Independently of the demo's own check: the saved outputs are equal bit for bit.
    from safetensors.torch import load_file

    eager = load_file(str(out / "eager-output.safetensors"))["out"]
    staged = load_file(str(out / "staged-output.safetensors"))["out"]
    assert eager.shape == (SMALL.batch, SMALL.dim) and torch.equal(eager, staged)


def test_demo_traces_show_the_two_strategies(demo) -> None:
    _, _, stdout, _ = demo
    report = json.loads(stdout)["report"]
    assert report["stages"] == ["setup", "encode", "denoise", "decode"]
    eager, staged = report["traces"]
    assert (eager["label"], staged["label"]) == ("eager", "staged")
    assert eager["loads"]["count"] == staged["loads"]["count"] == 3
    assert eager["releases"]["count"] == 0  # eager keeps everything
    assert staged["releases"]["count"] == 2  # encoder on denoise, denoiser on decode
    weights = sum(SMALL.model_bytes(m) for m in MODELS)
    assert eager["loads"]["bytes"] == staged["loads"]["bytes"] == weights
    assert eager["samples"] > 0 and staged["samples"] > 0 and eager["complete"]


def test_demo_progress_says_threads_are_pinned(demo) -> None:
    _, _, _, stderr = demo
    assert "torch threads pinned to" in stderr
    assert "[4/4] outputs: bit-identical" in stderr
    assert "staged: released encoder" in stderr


def test_cached_weights_are_reused_and_checked(demo, cache: Path) -> None:
    folder = weights_dir(SMALL, cache)
    assert weights_valid(SMALL, folder)
    assert ensure_weights(SMALL, cache) == (folder, False)
    # A truncated file is not valid: the next run regenerates it.
    path = folder / "denoiser.safetensors"
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    assert not weights_valid(SMALL, folder)
    assert ensure_weights(SMALL, cache) == (folder, True)
    assert path.read_bytes() == original  # same seed, same bytes


def test_loads_mid_run_need_rng_preservation(demo, cache: Path) -> None:
    """The pipeline draws noise right after fetching each model, so a lazily built model
    changes the output unless its load preserves the RNG: the control must differ.

    Reference: eager, ``make_models("eager")`` with every model loaded before the run (the
    same ``load_model`` loaders), in this process; this process's default torch threads on
    both sides."""
    folder = weights_dir(SMALL, cache)

    def run(mode: str, preserve: bool) -> torch.Tensor:
        models = make_models(mode, SMALL, folder, preserve_rng=preserve)
        if mode == "eager":
            for name in MODELS:
                models[name]
        return run_pipeline(models, SMALL, models.enter)

    eager = run("eager", True)
    assert torch.equal(eager, run("staged", True))
    assert not torch.equal(eager, run("staged", False))


def test_compare_outputs_sees_a_difference(demo, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _, out, _, _ = demo
    for mode in ("eager", "staged"):
        tensor = load_file(str(out / f"{mode}-output.safetensors"))["out"]
        if mode == "staged":
            tensor = tensor.clone()
            tensor[0, 0] = torch.nextafter(tensor[0, 0], torch.tensor(2.0))  # one ulp
        save_file({"out": tensor}, str(tmp_path / f"{mode}-output.safetensors"))
    identical, diff = compare_outputs(tmp_path)
    assert not identical and 0 < diff < 1e-5


def _code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--interval", "0"], "interval must be more than 0 seconds, got '0'"),
        (["--interval", "-1"], "duration must not be negative, got '-1'"),
        (["-o", "a-file"], "-o: 'a-file' is a file, not a folder"),
        (["--cache", "a-file"], "--cache: 'a-file' is a file, not a folder"),
        (["--cache", "a-file/sub"], "--cache: cannot create folder 'a-file/sub'"),
    ],
)
def test_bad_values_are_usage_errors_before_any_work(
    tmp_path: Path, monkeypatch, capsys, flags: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    assert _code(["demo", "--size", "small", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "stageload-demo").exists() or flags[0] == "--cache"


def test_bad_flags_are_usage_errors(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--threads", "0", "-o", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as info:
        main(["demo", "--size", "huge"])
    assert info.value.code == 2


def test_an_interrupted_demo_leaves_no_worker_running() -> None:
    """Ctrl-C (here: KeyboardInterrupt from the progress callback) while a run's output
    streams in must not leave that worker behind. The worker is a stand-in that prints and
    sleeps: the real one imports torch first, seconds of start-up for the same code path."""
    import os
    import sys

    import psutil

    from stageload.demo import _relay

    workers: list[psutil.Process] = []

    def command(child: psutil.Process) -> str:
        try:
            return " ".join(child.cmdline())
        except psutil.Error:  # a zombie another test's child left, or one gone meanwhile
            return ""

    def interrupt(line: str) -> None:
        assert line == "ready"
        # Only the worker: other tests may have left multiprocessing's resource tracker
        # running as a child of this process, which is not ours to judge.
        workers.extend(c for c in psutil.Process().children() if worker in command(c))
        raise KeyboardInterrupt

    worker = "import time; print('ready', flush=True); time.sleep(60)"
    with pytest.raises(KeyboardInterrupt):
        _relay([sys.executable, "-c", worker], dict(os.environ), interrupt)
    assert workers, "the worker was running when its first line came"
    for proc in workers:
        assert not proc.is_running(), "worker still running"
