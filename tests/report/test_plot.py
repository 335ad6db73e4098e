"""Plots: a real PNG from traces, through the library and the CLI; matplotlib stays optional."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from fixtures.full_disk import fill, small_tmpfs
from fixtures.traces import eager_records, staged_records, write_real_trace, write_trace
from stageload.cli import main
from stageload.report.plot import draw_traces, plot_traces

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IEND = b"IEND\xaeB`\x82"  # the last chunk of a whole PNG


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    eager = write_trace(tmp_path / "eager.jsonl", eager_records())
    staged = write_trace(tmp_path / "staged.jsonl", staged_records())
    return eager, staged


def test_plot_writes_a_png(pair, tmp_path: Path) -> None:
    out = plot_traces(pair, tmp_path / "out.png")
    width, height = png_size(out)
    assert width > 500 and height > 500
    assert out.stat().st_size > 10_000  # a drawn figure, not an empty canvas


@pytest.mark.parametrize("refused", [True, False], ids=["fixed", "control"])
def test_a_missing_folder_is_refused_not_made(
    pair, tmp_path: Path, monkeypatch, capsys, refused
) -> None:
    """``plot -o /nonexist/x.png`` made ``/nonexist`` (a typo became a folder). Now the
    library raises and the CLI exits 2, naming the folder and the fix. Control: with the
    folder made as before, both write the image into a new folder."""
    import stageload.report.plot as plot_module

    if not refused:
        monkeypatch.setattr(
            plot_module, "_check_folder", lambda out: out.parent.mkdir(parents=True)
        )
        monkeypatch.setattr("stageload.cli.args.unwritable_file", lambda path: None)
    folder = tmp_path / "nonexist"
    cli = ["plot", *map(str, pair), "-o", str(folder / "cli" / "x.png")]
    if refused:
        with pytest.raises(FileNotFoundError, match=r"folder '.*nonexist' does not exist; create"):
            plot_traces(pair, folder / "x.png")
        assert main(cli) == 2
        err = capsys.readouterr().err
        assert f"folder {str(folder / 'cli')!r} does not exist; create it" in err
        assert "Traceback" not in err
        assert not folder.exists()
    else:
        png_size(plot_traces(pair, folder / "x.png"))
        assert main(cli) == 0 and png_size(folder / "cli" / "x.png")


@pytest.mark.parametrize("whole", [True, False], ids=["fixed", "control"])
def test_a_full_disk_leaves_the_older_image_whole_and_no_empty_file(
    pair, tmp_path: Path, monkeypatch, capsys, whole
) -> None:
    """On a real full disk (a 256 KiB tmpfs, filled; skipped where it cannot be mounted)
    the image was saved in place: a good PNG became a truncated one, and a first image a
    0-byte file. Now it goes to a temporary file renamed over -o: exit 1 (as --help says,
    as report's full disk), the older PNG byte for byte, no new or temporary file.
    Control: saved in place as before."""
    import stageload.report.plot as plot_module

    if not whole:
        monkeypatch.setattr(
            plot_module, "_save_whole", lambda fig, out, **kw: fig.savefig(out, **kw)
        )
    with small_tmpfs(tmp_path / "disk", size="256k") as disk:
        good, new = disk / "good.png", disk / "new.png"
        assert main(["plot", str(pair[0]), "-o", str(good)]) == 0
        before = good.read_bytes()
        fill(disk)
        capsys.readouterr()
        codes = [main(["plot", *map(str, pair), "-o", str(out)]) for out in (good, new)]
        err = capsys.readouterr().err
        after, left = good.read_bytes(), sorted(p.name for p in disk.iterdir())
    assert "Traceback" not in err
    if whole:
        assert codes == [1, 1], err
        assert err.count("No space left on device") == 2, err
        assert after == before and after.endswith(IEND) and left == ["filler", "good.png"]
    else:
        assert not after.endswith(IEND) and "new.png" in left  # cut short, and a stub


def test_an_image_is_replaced_whole_keeping_its_mode(pair, tmp_path: Path) -> None:
    """A second plot to the same name replaces the image and keeps its mode; nothing else
    is left in the folder."""
    out = tmp_path / "out.png"
    plot_traces(pair[:1], out)
    out.chmod(0o640)
    one = out.read_bytes()
    plot_traces(pair, out)
    assert out.read_bytes() != one and png_size(out)
    assert out.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eager.jsonl", "out.png", "staged.jsonl"]


@pytest.mark.parametrize("through", [True, False], ids=["fixed", "control"])
def test_a_symbolic_link_is_written_through_and_stays_a_link(
    pair, tmp_path: Path, monkeypatch, capsys, through: bool
) -> None:
    """``-o out.png``, a link to an image elsewhere (relative, absolute, a chain of two,
    and one to a file not made yet): the new image replaces the link's target, and the
    link stays the same link; renamed over the link itself, it became a regular file and
    the target kept the older image. Library and CLI, nothing left over in either folder.
    Control: the rename over the path as given."""
    import stageload.report.plot as plot_module

    if not through:
        monkeypatch.setattr(plot_module, "_written_file", lambda out: out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    old = plot_traces(pair[:1], elsewhere / "old.png").read_bytes()
    links = {
        "relative.png": "elsewhere/relative-target.png",
        "absolute.png": str(elsewhere / "absolute-target.png"),
        "chain.png": "relative.png",  # -> elsewhere/relative-target.png
        "new.png": "elsewhere/not-yet.png",
    }
    for name, to in links.items():
        if "target" in to:
            (tmp_path / to).write_bytes(old)
        (tmp_path / name).symlink_to(to)
    kept = []
    for name in ("relative.png", "absolute.png", "new.png"):
        plot_traces(pair, tmp_path / name)
        kept.append((tmp_path / name).is_symlink())
    assert main(["plot", *map(str, pair), "-o", str(tmp_path / "chain.png")]) == 0
    capsys.readouterr()
    kept.append((tmp_path / "chain.png").is_symlink())
    assert all(kept) is through, kept
    if through:
        for name, to in links.items():
            assert os.readlink(tmp_path / name) == to
        for target in ("relative-target.png", "absolute-target.png", "not-yet.png"):
            image = (elsewhere / target).read_bytes()
            assert image != old and image.endswith(IEND) and png_size(elsewhere / target)
        assert sorted(p.name for p in elsewhere.iterdir()) == [
            "absolute-target.png", "not-yet.png", "old.png", "relative-target.png"
        ]  # fmt: skip
    else:  # the links are gone, their targets as they were
        assert (elsewhere / "absolute-target.png").read_bytes() == old
        assert not (elsewhere / "not-yet.png").exists()


def test_through_a_link_a_full_disk_leaves_the_older_image_whole(pair, tmp_path: Path) -> None:
    """The write through a link is as whole as any: on a real full disk (a 256 KiB tmpfs,
    filled; skipped where it cannot be mounted) the link's target keeps its older image
    byte for byte, the link stays, and no temporary file is left beside the target."""
    with small_tmpfs(tmp_path / "disk", size="256k") as disk:
        good = disk / "good.png"
        plot_traces(pair[:1], good)
        before = good.read_bytes()
        link = tmp_path / "out.png"
        link.symlink_to(good)
        fill(disk)
        with pytest.raises(OSError, match="No space left on device"):
            plot_traces(pair, link)
        after, left = good.read_bytes(), sorted(p.name for p in disk.iterdir())
    assert after == before and after.endswith(IEND) and left == ["filler", "good.png"]
    assert link.is_symlink()


def test_a_hard_link_to_the_image_keeps_the_older_image_whole(pair, tmp_path: Path) -> None:
    """The image is renamed into place (never a half file), so the name written gets a new
    file: another hard link to the older image keeps that image, whole. Writing in place
    instead would update both names and could leave both half written."""
    out, other = tmp_path / "out.png", tmp_path / "other.png"
    plot_traces(pair[:1], out)
    os.link(out, other)
    before = other.read_bytes()
    plot_traces(pair, out)
    assert other.read_bytes() == before and out.read_bytes() != before and png_size(out)
    assert other.stat().st_nlink == out.stat().st_nlink == 1


def test_a_link_into_a_missing_folder_names_that_folder(pair, tmp_path: Path) -> None:
    """A link to a file in a folder that does not exist: the error named the temporary
    file (``.x.png.1a2b3c4d.tmp``); now the folder, and the fix, as for a plain path."""
    (tmp_path / "out.png").symlink_to("nowhere/x.png")
    with pytest.raises(FileNotFoundError, match=r"folder '.*nowhere' does not exist; create"):
        plot_traces(pair, tmp_path / "out.png")
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "out.png").is_symlink()


def test_more_traces_make_a_taller_figure(pair, tmp_path: Path) -> None:
    one = png_size(plot_traces(pair[:1], tmp_path / "one.png"))
    two = png_size(plot_traces(pair, tmp_path / "two.png"))
    assert two[0] == one[0] and two[1] > one[1]


def test_cli_plot(pair, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli.png"
    assert main(["plot", *map(str, pair), "-o", str(out)]) == 0
    assert png_size(out)[0] > 0
    assert str(out) in capsys.readouterr().out


def test_cli_plot_bad_trace_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["plot", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("dpi", ["100000", "0", "-5", "9", "1201"])
def test_cli_plot_dpi_out_of_range_is_a_usage_error(pair, tmp_path: Path, dpi: str) -> None:
    out = tmp_path / "x.png"
    result = subprocess.run(
        [sys.executable, "-m", "stageload", "plot", *map(str, pair), "-o", str(out), "--dpi", dpi],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert f"--dpi must be from 10 to 1200, got {dpi}" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


@pytest.mark.parametrize(
    ("name", "starts"),
    [
        ("out.pdf", b"%PDF-"),
        ("out.svg", b"<?xml"),
        ("out.jpg", b"\xff\xd8\xff"),
        ("out", PNG_SIGNATURE),
    ],
)
def test_cli_plot_writes_the_format_the_suffix_names(
    pair, tmp_path: Path, capsys, name: str, starts: bytes
) -> None:
    """-o out.pdf wrote PNG bytes under that name (and said 'wrote out.pdf')."""
    out = tmp_path / name
    assert main(["plot", *map(str, pair), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(starts)
    if name == "out.svg":
        assert b"<svg" in out.read_bytes()[:1000]


def test_cli_plot_refuses_a_suffix_of_no_image_format(pair, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.xyz"
    assert main(["plot", *map(str, pair), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stageload plot: error: -o {str(out)!r}: cannot write a '.xyz' image")
    assert ".png" in err and ".pdf" in err and ".svg" in err and err.count("\n") == 1
    assert not out.exists()


def test_plot_traces_refuses_a_dpi_out_of_range(pair, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dpi must be a whole number from 10 to 1200"):
        plot_traces(pair, tmp_path / "x.png", dpi=100_000)


def test_cli_plot_output_name_too_long_is_a_usage_error(pair, tmp_path: Path, capsys) -> None:
    out = tmp_path / ("p" * 300 + ".png")
    assert main(["plot", *map(str, pair), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "too long" in err and "Traceback" not in err


def test_without_matplotlib_the_error_says_what_to_install(pair, tmp_path, monkeypatch, capsys):
    # This machine has matplotlib; hiding it from the import system fakes a bare install.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["plot", str(pair[0]), "-o", str(tmp_path / "x.png")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err


def test_importing_report_and_plot_stays_light() -> None:
    code = (
        "import sys, stageload.report.trace, stageload.report.tables, stageload.report.plot, "
        "stageload.cli.report, stageload.cli.plot\n"
        "heavy = [m for m in ('matplotlib', 'torch', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plot_real_meter_traces(tmp_path: Path) -> None:
    plan = [("a", 32), ("b", 32)]
    eager = write_real_trace(tmp_path / "eager.jsonl", "eager", plan, hold=True)
    staged = write_real_trace(tmp_path / "staged.jsonl", "staged", plan, hold=False)
    out = tmp_path / "real.png"
    assert main(["plot", str(eager), str(staged), "-o", str(out)]) == 0
    width, height = png_size(out)
    assert width > 500 and height > 500 and out.stat().st_size > 10_000


def test_swap_growth_beyond_the_footprint_stays_on_the_panel(tmp_path: Path) -> None:
    """Swap can grow more than the run's own footprint (the seeds' offload run: 18.5 GB
    footprint, +9.6 GB swap; a guard trace of a small tree on a swapping machine more so).
    Its line shares the footprint axis and must fit under the top of it."""
    records = eager_records()
    swap = [r for r in records if r["type"] == "sample"]
    for i, sample in enumerate(swap):  # grows to 4x the highest footprint
        sample["swap_used"] = i * 4 * max(s["footprint"] for s in swap) // (len(swap) - 1)
    path = write_trace(tmp_path / "swapping.jsonl", records)
    fig = draw_traces([path])
    panel = fig.axes[0]
    (swap_line,) = [line for line in panel.get_lines() if line.get_label() == "swap growth"]
    assert max(swap_line.get_ydata()) <= panel.get_ylim()[1]
    assert min(swap_line.get_ydata()) >= panel.get_ylim()[0]


def test_a_line_of_one_sample_is_drawn_as_a_marker(tmp_path: Path) -> None:
    """A run shorter than the interval has one sample: its line of one point drew nothing,
    under a title that said 'peak 150 MiB'."""
    records = [
        {"type": "start", "meta": {"label": "one"}},
        {"type": "event", "t": 0.0, "kind": "stage", "stage": "a"},
        {"type": "sample", "t": 0.1, "footprint": 150 << 20, "available": 10 << 30,
         "available_pct": 60.0, "swap_used": 0},
        {"type": "end", "t": 0.3, "samples": 1},
    ]  # fmt: skip
    fig = draw_traces([write_trace(tmp_path / "one.jsonl", records)])
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    for name in ("footprint", "swap growth", "available (right, GiB)"):
        assert len(lines[name].get_xdata()) == 1
        assert lines[name].get_marker() == "o", name


# The old write of a file that exists and is not a regular one (a device, a pipe, a
# socket), with no check of ``out`` before it: ``fig.savefig(target)`` in place.
OLD_SAVE = (
    "plot._refuse_pipe = lambda *args: None\n"
    "plot._save_whole = lambda fig, target, **kw: fig.savefig(target, **kw)\n"
)


def _plot_in_child(traces: Sequence[Path], out: Path, *, checked: bool) -> subprocess.Popen[str]:
    """``plot_traces(traces, out)`` in a child, which prints ``drawn N`` (how many figures
    it drew) at its end. Unchecked: the old code (``OLD_SAVE``)."""
    code = (
        "import atexit, sys\n"
        "import stageload.report.plot as plot\n"
        "drawn = []\n"
        "draw = plot.draw_traces\n"
        "plot.draw_traces = lambda traces: drawn.append(1) or draw(traces)\n"
        "atexit.register(lambda: print('drawn', len(drawn), flush=True))\n"
        + ("" if checked else OLD_SAVE)
        + "plot.plot_traces(sys.argv[1:-1], sys.argv[-1])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, traces), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(child: subprocess.Popen[str]) -> tuple[str, str]:
    """The child's stdout and stderr once it ends; 120 s bounds a hang, it is no expected
    time (a child that waits on a pipe for ever fails the test instead of stopping it)."""
    try:
        return child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _read_as_reader(fifo: Path, child: subprocess.Popen[str]) -> bytes:
    """All a child writes into ``fifo``, read by the test as the pipe's reader: a blocking
    open for reading returns only once a writer has opened the pipe, so the child is
    left waiting in its own open until then. Should the child end without opening it,
    the test opens it for writing itself, so that its reader does not wait for ever."""
    import threading

    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as reader:
            got.append(reader.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    child.wait(timeout=120)  # a bound on a hang, not an expected time
    thread.join(timeout=0)
    if thread.is_alive():  # the child never opened the pipe: let the reader go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
    return got[0]


@pytest.mark.parametrize("checked", [True, False], ids=["fixed", "control"])
@pytest.mark.parametrize("kind", ["fifo.svg", "fifo.png", "link-to-fifo.svg", "socket.png"])
def test_plot_traces_refuses_a_pipe_or_socket_before_drawing(
    pair, tmp_path: Path, kind: str, checked: bool
) -> None:
    """The CLI refuses ``-o FIFO`` (exit 2), but ``plot_traces(traces, FIFO)`` drew the
    figure and then saved it into the pipe in place: an SVG (or PDF) waited in the open
    for a reader, for ever with none; a PNG failed with a bare 'not seekable' (PIL opens
    it for reading and writing, which does not wait); a socket with 'No such device or
    address'. Now each, and a link to a pipe, is refused before any drawing with
    ``NotAFileError`` naming the path as given, and the pipe stays a pipe. Control: the
    old code (``OLD_SAVE``): the SVG child waits in its open until the test comes as the
    pipe's reader, then writes the image into it; the others fail after the drawing."""
    suffix = Path(kind).suffix
    fifo = tmp_path / f"pipe{suffix}"  # a suffix of an image format: the pipe is the fault
    if kind.startswith("socket"):
        import socket

        out = tmp_path / f"socket{suffix}"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(out))
    else:
        os.mkfifo(fifo)
        out = fifo
        if kind.startswith("link"):
            out = tmp_path / f"out{suffix}"
            out.symlink_to(fifo.name)
    child = _plot_in_child(pair, out, checked=checked)
    piped = b""
    if not checked and suffix == ".svg":  # it waits in the open: come as its reader
        piped = _read_as_reader(fifo, child)
    stdout, err = _finish(child)
    if kind.startswith("socket"):
        server.close()
        assert out.is_socket()
    else:
        assert fifo.is_fifo() and out.is_symlink() is kind.startswith("link")
    what = "a socket" if kind.startswith("socket") else "a named pipe (FIFO)"
    if checked:
        assert child.returncode == 1 and "NotAFileError" in err, err
        assert f"image file {str(out)!r} is {what}, not a regular file" in err, err
        assert "give the path of a regular file" in err, err
        assert stdout == "drawn 0\n"
        return
    assert stdout == "drawn 1\n"
    if kind.startswith("socket"):
        assert child.returncode == 1 and "No such device or address" in err, err
    elif suffix == ".png":
        assert child.returncode == 1 and "not seekable" in err, err
    else:
        assert child.returncode == 0, err
        assert piped.startswith(b"<?xml") and piped.rstrip().endswith(b"</svg>")


@pytest.mark.parametrize("checked", [True, False], ids=["fixed", "control"])
def test_a_pipe_that_appears_while_drawing_is_refused_not_waited_on(
    tmp_path: Path, checked: bool
) -> None:
    """A pipe put at ``out`` after the check (the drawing takes seconds) reached the old
    ``fig.savefig(out)``, which for an SVG waited in the open for a reader, for ever with
    none. The write of a file that is not a regular one now opens it with O_NONBLOCK:
    ENXIO, said as the pipe it is. Control: the old code (``OLD_SAVE``): the child waits
    in its open until the test comes as the reader, and writes the SVG into the pipe."""
    fifo = tmp_path / "late.svg"
    os.mkfifo(fifo)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from matplotlib.figure import Figure\n"
        "import stageload.report.plot as plot\n"
        + ("" if checked else OLD_SAVE)
        + "plot._save_whole(Figure(), Path(sys.argv[1]), format='svg')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(fifo)], env=env, stderr=subprocess.PIPE, text=True
    )
    piped = _read_as_reader(fifo, child) if not checked else b""
    _, err = _finish(child)
    if checked:
        assert child.returncode == 1 and "NotAFileError" in err, err
        assert f"image file {str(fifo)!r} is a named pipe (FIFO)" in err, err
    else:
        assert child.returncode == 0 and piped.startswith(b"<?xml"), err
    assert fifo.is_fifo()
