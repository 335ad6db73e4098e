"""``stageload plot``: draw traces as a PNG (memory over time per trace, peak per stage)."""

from __future__ import annotations

import argparse
import sys

HELP = "plot traces: memory over time with stage bands, and peak per stage (PNG)"
DESCRIPTION = """\
Draw one or more traces into one PNG: a panel per trace with the process footprint and
swap growth (left axis) and available memory (right axis) over time, the stage windows
as shaded bands with their names, and at the bottom a bar chart of the peak footprint
per stage, one bar per trace. Needs matplotlib: pip install matplotlib.

examples:
  stageload plot eager.jsonl staged.jsonl -o compare.png
  stageload plot run.jsonl -o run.png --dpi 150

exit codes: 0 ok, 1 matplotlib missing, 2 a file is missing or is not a trace.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="JSONL trace files")
    parser.add_argument(
        "-o", "--output", required=True, metavar="PNG", help="where to write the PNG"
    )
    parser.add_argument(
        "--dpi", type=int, default=110, help="resolution, from 10 to 1200 (default: 110)"
    )


def run(args: argparse.Namespace) -> int:
    from ..report.plot import MAX_DPI, MIN_DPI, PlotUnavailableError, plot_traces
    from ..report.records import TraceError

    if not MIN_DPI <= args.dpi <= MAX_DPI:
        print(
            f"stageload plot: error: --dpi must be from {MIN_DPI} to {MAX_DPI}, "
            f"got {args.dpi!r}; e.g. --dpi 150",
            file=sys.stderr,
        )
        return 2
    try:
        out = plot_traces(args.traces, args.output, dpi=args.dpi)
    except TraceError as exc:
        print(f"stageload plot: error: {exc}", file=sys.stderr)
        return 2
    except PlotUnavailableError as exc:
        print(f"stageload plot: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"stageload plot: error: cannot write {args.output!r}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {out}")
    return 0
