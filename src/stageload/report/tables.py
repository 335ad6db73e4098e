"""Tables that compare traces per stage, such as eager against staged, and their JSON form."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..memory import DEVICE_KEYS
from ..text import printable
from ..traceformat import MAX_T
from ..units import format_duration, format_size
from .trace import NO_REASON, Activity, Blocks, Summary

#: What a cell shows for a stage the trace never reached.
NOT_REACHED = "-"
# How many numbers of skipped lines a note lists before "...".
_LINES_SHOWN = 10

_DEVICE_NAMES = {
    "cuda_allocated": "cuda alloc",
    "cuda_reserved": "cuda reserved",
    "mps_current": "mps",
    "mps_driver": "mps driver",
}


def stage_order(summaries: Sequence[Summary]) -> list[str]:
    """Every stage of every trace, in the order they were first seen across the traces."""
    order: list[str] = []
    for summary in summaries:
        for stage in summary.stages:
            if stage.stage not in order:
                order.append(stage.stage)
    return order


def _cell(text: str) -> str:
    return printable(text).replace("|", "\\|")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table padded so it also reads well in a terminal. A ``|`` in a cell (a
    label, a stage name) is escaped as ``\\|``: bare, it would start another cell; a newline
    or an ESC as ``\\n``, ``\\x1b`` (``text.printable``): raw, it would break the row or
    drive the terminal."""
    header = [_cell(h) for h in header]
    rows = [[_cell(c) for c in row] for row in rows]
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _stage_cell(summary: Summary, name: str) -> str:
    stage = summary.stage(name)
    if stage is None:
        return NOT_REACHED
    peak = "no sample" if stage.peak_footprint is None else format_size(stage.peak_footprint)
    cell = f"{peak}, {format_duration(stage.duration)}"
    if stage.windows > 1:
        cell += f" ({stage.windows}x)"
    return cell


def _device_cell(summary: Summary, name: str) -> str:
    stage = summary.stage(name)
    if stage is None:
        return NOT_REACHED
    parts = [
        f"{_DEVICE_NAMES[k]} {format_size(stage.device_peak[k])}"
        for k in DEVICE_KEYS
        if k in stage.device_peak
    ]
    return ", ".join(parts) or "none"


def _activity(activity: Activity) -> str:
    if activity.count == 0:
        return "0"
    return f"{activity.count}: {format_size(activity.bytes)} in {format_duration(activity.seconds)}"


def _blocks_cell(model: str) -> Any:
    def cell(summary: Summary) -> str:
        blocks = summary.blocks.get(model, Blocks())
        if blocks.count == 0:
            return "0"
        return (
            f"{blocks.count}: {format_size(blocks.bytes)} read in "
            f"{format_duration(blocks.seconds)}, computed {format_duration(blocks.compute)}"
        )

    return cell


def _reason_cell(reason: str) -> Any:
    def cell(summary: Summary) -> str:
        return _activity(summary.releases_by_reason.get(reason, Activity()))

    return cell


def _available(summary: Summary) -> str:
    size = format_size(summary.lowest_available)
    if summary.lowest_available_pct is None:
        return size
    return f"{size} ({summary.lowest_available_pct:.1f} %)"


def _duration(summary: Summary) -> str:
    text = format_duration(summary.duration)
    return text if summary.complete else f"{text} (no end record)"


def whole_run_rows(summaries: Sequence[Summary]) -> list[list[str]]:
    """The rows about each run as a whole: peak, swap, available memory, loads, releases
    (and, indented below them, the releases by reason where the trace says why)."""
    rows: list[tuple[str, Any]] = [
        ("peak footprint", lambda s: format_size(s.peak_footprint)),
        ("duration", _duration),
        (
            "swap start / peak / end",
            lambda s: " / ".join(format_size(v) for v in (s.swap_start, s.swap_peak, s.swap_end)),
        ),
        ("swap growth", lambda s: format_size(s.swap_growth)),
        ("lowest available", _available),
        ("loads", lambda s: _activity(s.loads)),
        ("reloads", lambda s: _activity(s.reloads)),
        ("releases", lambda s: _activity(s.releases)),
        ("samples", lambda s: str(s.samples)),
    ]
    reasons: list[str] = []
    for summary in summaries:
        reasons += [r for r in summary.releases_by_reason if r not in reasons]
    if reasons != [NO_REASON] and reasons:  # say why models were released, where known
        at = [name for name, _ in rows].index("releases") + 1
        rows[at:at] = [(f"  {reason}", _reason_cell(reason)) for reason in reasons]
    if any(s.exit_code is not None for s in summaries):
        rows.insert(2, ("exit code", lambda s: "-" if s.exit_code is None else str(s.exit_code)))
    if any(s.prefetches.count for s in summaries):  # only runs with prefetch have them
        at = [name for name, _ in rows].index("releases")
        rows.insert(at, ("prefetches", lambda s: _activity(s.prefetches)))
    streamed: list[str] = []
    for summary in summaries:  # streamed models: blocks read, bytes, read vs compute time
        streamed += [m for m in summary.blocks if m not in streamed]
    at = [name for name, _ in rows].index("samples")
    rows[at:at] = [(f"blocks of {model}", _blocks_cell(model)) for model in streamed]
    if any(s.marks for s in summaries):
        rows.append(("marks", lambda s: str(len(s.marks))))
    return [[name, *(fn(s) for s in summaries)] for name, fn in rows]


def format_report(summaries: Sequence[Summary]) -> str:
    """The text report: peak footprint per stage, device peaks if any, then the whole run."""
    if not summaries:
        raise ValueError("format_report needs at least one trace summary")
    labels = column_labels(summaries)
    stages = stage_order(summaries)
    parts = [
        "Peak footprint and time per stage "
        "(a stage starts once the releases it triggered have finished)",
        "",
        markdown_table(
            ["stage", *labels], [[n, *(_stage_cell(s, n) for s in summaries)] for n in stages]
        ),
    ]
    if any(st.device_peak for s in summaries for st in s.stages):
        parts += [
            "",
            "Device memory peak per stage",
            "",
            markdown_table(
                ["stage", *labels], [[n, *(_device_cell(s, n) for s in summaries)] for n in stages]
            ),
        ]
    parts += ["", "Whole run", "", markdown_table(["", *labels], whole_run_rows(summaries))]

    notes = []
    for label, summary in zip(labels, summaries, strict=True):
        for mark in summary.marks:
            notes.append(f"mark   {label}: {mark.label!r} at {format_duration(mark.t)}")
        notes += [f"note   {label}: {note}" for note in summary.notes]
        for name, message in summary.read_errors.items():
            notes.append(
                f"unread {label}: {name} ({message})" if message else f"unread {label}: {name}"
            )
        notes += _skipped_notes(label, summary)
    if notes:  # one line each, whatever a label or a trace's text holds
        parts += ["", *map(printable, notes)]
    return "\n".join(parts)


def _skipped_notes(label: str, summary: Summary) -> list[str]:
    """Lines that say what the reader skipped, so a damaged trace does not pass for whole."""
    notes = []
    lines = summary.bad_lines
    if lines:
        shown = ", ".join(map(str, lines[:_LINES_SHOWN])) + (
            ", ..." if len(lines) > _LINES_SHOWN else ""
        )
        notes.append(
            f"skipped {label}: {len(lines)} line(s) that are not a JSON record: cut, garbled "
            f"or too long (line {shown})"
        )
    if summary.bad_times:
        notes.append(
            f"skipped {label}: {summary.bad_times} record(s) whose t is missing, not a number, "
            f"negative or over {MAX_T:g} s"
        )
    if summary.dropped:
        count = sum(summary.dropped.values())
        keys = ", ".join(f"{k} {n}" for k, n in summary.dropped.items())
        notes.append(
            f"dropped {label}: {count} value(s) of the wrong type or out of range ({keys})"
        )
    return notes


def report_dict(summaries: Sequence[Summary]) -> dict[str, Any]:
    """The report as JSON-ready data: stage order and one summary per trace."""
    labels = column_labels(summaries)
    traces = []
    for label, summary in zip(labels, summaries, strict=True):
        data = summary.to_dict()
        data["column"] = label
        traces.append(data)
    return {"stages": stage_order(summaries), "traces": traces}


def column_labels(summaries: Sequence[Summary]) -> list[str]:
    """Column headers: each trace's label, numbered when two traces share one."""
    labels = [s.label for s in summaries]
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        if labels.count(label) > 1:
            seen[label] = seen.get(label, 0) + 1
            out.append(f"{label} #{seen[label]}")
        else:
            out.append(label)
    return out
