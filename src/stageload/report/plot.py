"""Plot traces: memory over time with stage bands, one panel per trace, and peaks per stage.

matplotlib is an optional extra (``stageload[plot]``) and is imported only inside these
functions, so ``import stageload`` stays light. Drawing goes through a bare ``Figure`` and
the Agg canvas, never pyplot, so the caller's matplotlib backend is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.events import SETUP
from ..errors import StageloadError
from .processes import by_process, load_views
from .samples import SampleStats
from .tables import column_labels, stage_order
from .trace import Summary, Trace, sample_stats, summarize

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_GIB = 1 << 30
_MIB = 1 << 20
# Light fills that alternate between neighbouring stages; setup stays white.
_BAND_COLORS = ("#dbe9f6", "#fde9d5", "#e2f1de", "#ece3f3", "#f9e0e6", "#e6eef0")


class PlotUnavailableError(StageloadError, RuntimeError):
    """matplotlib is not installed."""

    def __init__(self) -> None:
        super().__init__("plots need matplotlib, which is not installed: pip install matplotlib")


class ImageFormatError(StageloadError, ValueError):
    """The suffix of a plot's file names no format matplotlib writes."""


def _unit(summaries: Sequence[Summary]) -> tuple[float, str]:
    # GiB for real pipelines, MiB when everything stays under 1 GiB (the small demo).
    peak = max((s.peak_footprint or 0 for s in summaries), default=0)
    return (_GIB, "GiB") if peak >= _GIB else (_MIB, "MiB")


def _line(trace: Trace, stats: SampleStats, name: str) -> list[tuple[float, float]]:
    """The kept points of one line (``footprint``, ``swap_used``, ``available``) of the
    samples in ``trace``'s span: every point, or a few thousand that keep the peaks."""
    if stats.lines is None:
        raise ValueError("the trace was read without its lines: read it with series=True")
    return stats.lines.points(name, trace.first_t, trace.last_t)


def _draw_trace(
    ax: Axes,
    trace: Trace,
    stats: SampleStats,
    summary: Summary,
    scale: float,
    unit: str,
    *,
    colors: dict[str, str],
    avail_max: float,
    span: float,
    legend: bool,
) -> None:
    fp = [(t, v / scale) for t, v in _line(trace, stats, "footprint")]
    start = summary.swap_start
    swap = (
        []
        if start is None
        else [(t, (v - start) / scale) for t, v in _line(trace, stats, "swap_used")]
    )
    avail = [(t, v / _GIB) for t, v in _line(trace, stats, "available")]

    # Labels sit just inside the top of their band. A label that would run into the one
    # before it (a short window) drops a row, so neighbours never overprint.
    label_ends: list[float] = []  # per row: where the last label there ends, in seconds
    char = span * 0.0075  # roughly one 8-pt character of a 10-inch-wide axis, in seconds
    for window in summary.windows:
        if window.stage in colors:
            ax.axvspan(window.start, window.end, color=colors[window.stage], lw=0, zorder=0)
        row = next((i for i, end in enumerate(label_ends) if window.start >= end), None)
        if row is None:
            row = len(label_ends)
            label_ends.append(0.0)
        label_ends[row] = window.start + char * (len(window.stage) + 2)
        ax.text(
            window.start,
            0.98 - 0.09 * (row % 4),
            f" {window.stage}",
            transform=ax.get_xaxis_transform(),
            va="top",
            ha="left",
            fontsize=8,
            clip_on=True,
            zorder=3,
        )
    for mark in trace.marks:
        ax.axvline(mark.t, color="0.4", lw=0.8, ls=":", zorder=2)
        ax.text(
            mark.t,
            0.02,
            f" {mark.label}",
            transform=ax.get_xaxis_transform(),
            fontsize=7,
            color="0.3",
            rotation=90,
            va="bottom",
            clip_on=True,
        )

    handles: list[Any] = []
    if fp:
        handles += ax.plot(
            *zip(*fp, strict=True), color="C0", lw=1.6, label="footprint", zorder=4, **_dot(fp)
        )
    if swap:
        handles += ax.plot(
            *zip(*swap, strict=True), color="C3", lw=1.2, label="swap growth", zorder=4,
            **_dot(swap),
        )  # fmt: skip
    ax.set_ylabel(unit)
    ax.margins(x=0)
    if avail:
        right = ax.twinx()
        handles += right.plot(
            *zip(*avail, strict=True), color="C2", lw=1.0, ls="--", label="available (right, GiB)",
            **_dot(avail),
        )  # fmt: skip
        # One scale for every panel, so the traces compare at a glance.
        right.set_ylim(0, avail_max * 1.05)
        right.set_ylabel("available, GiB", color="C2")
        right.tick_params(axis="y", colors="C2")
    if not summary.samples:
        ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", va="center")

    title = f"{summary.label}: peak {_fmt(summary.peak_footprint, scale, unit)}"
    if summary.swap_growth is not None:
        title += f", swap growth {_fmt(summary.swap_growth, scale, unit)}"
    if summary.lowest_available_pct is not None:
        title += f", lowest available {summary.lowest_available_pct:.0f} %"
    if not summary.complete:
        title += " (no end record)"
    ax.set_title(title, fontsize=10, loc="left")
    if legend and handles:
        # Above the panels, where it cannot hide a stage label or a line.
        ax.figure.legend(handles=handles, loc="outside upper right", ncols=3, fontsize=8)


def _dot(points: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """A marker for a line of one point, which a line alone draws as nothing."""
    return {"marker": "o", "markersize": 5} if len(points) == 1 else {}


def _fmt(value: int | None, scale: float, unit: str) -> str:
    return "-" if value is None else f"{value / scale:.2f} {unit}"


def _draw_peaks(ax: Axes, summaries: Sequence[Summary], scale: float, unit: str) -> None:
    stages = stage_order(summaries)
    labels = column_labels(summaries)
    width = 0.8 / max(len(summaries), 1)
    for k, (label, summary) in enumerate(zip(labels, summaries, strict=True)):
        xs, heights = [], []
        for i, name in enumerate(stages):
            stage = summary.stage(name)
            if stage is not None and stage.peak_footprint is not None:
                xs.append(i - 0.4 + width * (k + 0.5))
                heights.append(stage.peak_footprint / scale)
        bars = ax.bar(xs, heights, width=width * 0.95, label=label, color=f"C{k}")
        ax.bar_label(bars, fmt="%.2f" if unit == "GiB" else "%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(stages)), stages, fontsize=8, rotation=30 if len(stages) > 6 else 0)
    ax.set_ylabel(f"peak footprint, {unit}")
    ax.set_title("Peak footprint per stage", fontsize=10, loc="left")
    ax.margins(y=0.15)
    ax.legend(fontsize=8)


#: The resolutions ``plot_traces`` draws at: the figure is about 11 inches wide, so 1200
#: dpi is already 13,000 pixels across; far more exhausts memory (100,000: std::bad_alloc).
MIN_DPI, MAX_DPI = 10, 1200


def image_format(out: str | Path) -> str:
    """The format ``plot_traces`` writes to ``out``: the one its suffix names (``.pdf``,
    ``.svg``, ``.jpg``, ...), PNG when it has none. ``ValueError`` for a suffix matplotlib
    cannot write (``ImageFormatError``, naming those it can); ``PlotUnavailableError``
    without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise PlotUnavailableError() from None
    suffix = Path(out).suffix
    if not suffix:
        return "png"
    supported = FigureCanvasAgg.get_supported_filetypes()
    if suffix[1:].lower() not in supported:
        raise ImageFormatError(
            f"cannot write a {suffix!r} image; give a name ending in one of "
            f"{', '.join('.' + name for name in sorted(supported))} (PNG without a suffix)"
        )
    return suffix[1:].lower()


def plot_traces(traces: Sequence[str | Path | Trace], out: str | Path, *, dpi: int = 110) -> Path:
    """Draw ``traces`` into one image at ``out`` and return its path: a PNG, or the format
    the suffix of ``out`` names (``image_format``).

    ``dpi`` must be from ``MIN_DPI`` to ``MAX_DPI`` (``ValueError`` otherwise).

    The figure has one panel per trace (footprint and swap growth on the left axis,
    available memory on the right, stage windows as bands with their names, marks as
    dotted lines) on a shared time axis, and below them a bar chart of the peak footprint
    per stage, one bar per trace. Raises ``PlotUnavailableError`` without matplotlib, and
    ``FileNotFoundError`` when the folder of ``out`` does not exist, and ``NotAFileError``
    (an ``OSError``, from ``stageload.meter.tracefile``) when ``out`` is a named pipe or
    a socket, both before any drawing. A symbolic link at ``out`` is written through: the
    image replaces its target, and the link stays.
    """
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not MIN_DPI <= dpi <= MAX_DPI:
        raise ValueError(f"dpi must be a whole number from {MIN_DPI} to {MAX_DPI}, got {dpi!r}")
    kind = image_format(out)
    out = Path(out)
    target = _written_file(out)
    _check_folder(target)
    _refuse_pipe(out, target)
    fig = draw_traces(traces)
    _save_whole(fig, target, dpi=dpi, format=kind)
    return out


def _written_file(out: Path) -> Path:
    """The file that an image written to ``out`` replaces: through a symbolic link (or a
    chain of them, or one to a file not made yet), its target, so the link stays a link
    to the new image; renamed over ``out`` itself, the link became a regular file."""
    return Path(os.path.realpath(out)) if out.is_symlink() else out


#: Why an image cannot go to a pipe or a socket, in ``NotAFileError``'s message.
_WHY_NOT_A_PIPE = (
    "an image is saved to a temporary file renamed into place, which would replace the "
    "pipe or socket, and written into a pipe with no reader it would wait for ever"
)


def _refuse_pipe(out: Path, target: Path, mode: int | None = None) -> None:
    """``NotAFileError`` when ``target`` (``_written_file(out)``; or the file of ``mode``,
    its ``st_mode``) is a named pipe or a socket. Saved there after all the drawing, an SVG
    or PDF waited in the open for a reader (for ever with none), a PNG failed with 'not
    seekable', a socket with 'No such device or address'. The error names ``out``."""
    from ..meter.tracefile import NotAFileError, kind_of_pipe

    if mode is None:
        try:
            mode = os.stat(target).st_mode
        except FileNotFoundError:  # a new file: nothing there to be a pipe
            return
    what = kind_of_pipe(mode)
    if what is not None:
        raise NotAFileError(out, what, output="image file", why=_WHY_NOT_A_PIPE)


def _save_whole(fig: Figure, target: Path, **savefig: Any) -> None:
    """Save ``fig`` to a temporary file beside ``target`` (``_written_file``: a link's
    target), then rename it over ``target``: a write that fails (a full disk) leaves an
    older image whole and no part-written file (saved in place, a good PNG became a
    truncated one, and a first image a 0-byte file). The rename gives ``target`` a new
    file: another hard link to the older image keeps the older image, whole."""
    if target.exists() and not target.is_file():  # a device (/dev/null): nothing to replace
        from ..meter.tracefile import NONBLOCK  # here: the meter package costs 0.07 s

        # O_NONBLOCK: a pipe put here since the check (the drawing takes seconds) fails
        # the open (ENXIO: no reader) or is seen by the fstat, rather than make the write
        # wait for a reader.
        try:
            fd = os.open(target, os.O_WRONLY | NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                _refuse_pipe(target, target)
            raise
        with os.fdopen(fd, "wb") as file:
            _refuse_pipe(target, target, os.fstat(fd).st_mode)
            os.set_blocking(fd, True)  # a device is written as before
            fig.savefig(file, **savefig)
        return
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "wb") as file:
            fig.savefig(file, **savefig)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, target.stat().st_mode & 0o7777)  # an older image keeps its mode
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _check_folder(out: Path) -> None:
    """``FileNotFoundError`` naming the folder of ``out`` when it does not exist: it is
    never made for you (``-o /nonexist/x.png``, a typo, made ``/nonexist``)."""
    if not out.parent.is_dir():
        raise FileNotFoundError(
            errno.ENOENT,
            f"folder {str(out.parent)!r} does not exist; create it, or give a path in a "
            "folder that exists",
        )


def draw_traces(traces: Sequence[str | Path | Trace]) -> Figure:
    """The figure ``plot_traces`` saves, as a matplotlib ``Figure`` on the Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError() from None
    if not traces:
        raise ValueError("plot_traces needs at least one trace")

    # A trace with pipeline events from several processes gets one panel per process. A
    # file is read in bounded memory: figures per window and decimated lines, no samples.
    loaded = [
        view
        for t in traces
        for view in (by_process(t) if isinstance(t, Trace) else load_views([t], series=True))
    ]
    summaries = [summarize(t) for t in loaded]
    stats = [sample_stats(t, series=True) for t in loaded]
    scale, unit = _unit(summaries)

    # The same stage gets the same band colour in every panel; setup stays white.
    stages = [name for name in stage_order(summaries) if name != SETUP]
    colors = {name: _BAND_COLORS[i % len(_BAND_COLORS)] for i, name in enumerate(stages)}
    fp_max = max((s.peak_footprint or 0 for s in summaries), default=0) / scale
    # Swap growth shares the left axis: a run can swap more than its own footprint (other
    # processes pushed out), and that line must not run off the top (or below 0). The
    # decimated lines keep each bucket's lowest and highest point, so these are exact.
    swap_deltas = [
        (v - summary.swap_start) / scale
        for t, st, summary in zip(loaded, stats, summaries, strict=True)
        if summary.swap_start is not None
        for _, v in _line(t, st, "swap_used")
    ]
    top = max([fp_max, *swap_deltas])
    bottom = min([0.0, *swap_deltas])
    avail_max = (
        max(
            (v for t, st in zip(loaded, stats, strict=True) for _, v in _line(t, st, "available")),
            default=0,
        )
        / _GIB
    )

    span = max((t.last_t for t in loaded), default=0.0) or 1.0  # the shared time axis
    n = len(loaded)
    fig = Figure(figsize=(10, 2.6 * n + 3.0), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(n + 1, 1, height_ratios=[3] * n + [2.6])
    first: Axes | None = None
    for k, (trace, st, summary) in enumerate(zip(loaded, stats, summaries, strict=True)):
        ax = fig.add_subplot(grid[k], sharex=first, sharey=first)
        first = first or ax
        _draw_trace(
            ax,
            trace,
            st,
            summary,
            scale,
            unit,
            colors=colors,
            avail_max=avail_max,
            span=span,
            legend=k == 0,
        )
        ax.set_ylim(bottom * 1.12, max(top, 1e-9) * 1.12)
        if k == n - 1:
            ax.set_xlabel("seconds")
        else:
            ax.tick_params(labelbottom=False)
    _draw_peaks(fig.add_subplot(grid[n]), summaries, scale, unit)
    return fig
