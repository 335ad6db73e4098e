"""``stageload plot``: draw traces as an image (memory over time per trace, peak per stage)."""

from __future__ import annotations

import argparse
import sys

HELP = "plot traces: memory over time with stage bands, and peak per stage (PNG, PDF, SVG)"
DESCRIPTION = """\
Draw one or more traces into one image: a panel per trace with the process footprint and
swap growth (left axis) and available memory (right axis) over time, the stage windows
as shaded bands with their names, and at the bottom a bar chart of the peak footprint
per stage, one bar per trace. The image is a PNG, or the format the -o name's suffix
names (.pdf, .svg, .jpg, ...). Needs matplotlib: pip install matplotlib.

examples:
  stageload plot eager.jsonl staged.jsonl -o compare.png
  stageload plot run.jsonl -o run.png --dpi 150
  stageload plot run.jsonl -o run.pdf

The image is written whole or not at all: it goes to a temporary file beside -o, renamed
over -o once complete, so a failed write (a full disk) leaves an image already there as
it was. A symbolic link at -o is written through: its target gets the image, the link
stays.

exit codes: 0 ok, 1 matplotlib missing or the image cannot be written (e.g. a full disk),
2 a file is missing or is not a trace, the -o suffix names no image format matplotlib
writes, or the -o folder does not exist.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="JSONL trace files")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="IMAGE",
        help="where to write the image: a PNG, or the format its suffix names (.pdf, .svg, ...)",
    )
    parser.add_argument(
        "--dpi", type=int, default=110, help="resolution, from 10 to 1200 (default: 110)"
    )


def run(args: argparse.Namespace) -> int:
    from ..report.plot import (
        MAX_DPI,
        MIN_DPI,
        ImageFormatError,
        PlotUnavailableError,
        plot_traces,
    )
    from ..report.records import TraceError
    from . import EXIT_OUTPUT
    from .args import unwritable_file

    if not MIN_DPI <= args.dpi <= MAX_DPI:
        print(
            f"stageload plot: error: --dpi must be from {MIN_DPI} to {MAX_DPI}, "
            f"got {args.dpi!r}; e.g. --dpi 150",
            file=sys.stderr,
        )
        return 2
    problem = unwritable_file(args.output)  # a missing folder, before the traces are read
    if problem is not None:
        print(f"stageload plot: error: cannot write {args.output!r}: {problem}", file=sys.stderr)
        return 2
    try:
        out = plot_traces(args.traces, args.output, dpi=args.dpi)
    except ImageFormatError as exc:  # said before the traces are read
        print(f"stageload plot: error: -o {args.output!r}: {exc}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"stageload plot: error: {exc}", file=sys.stderr)
        return 2
    except PlotUnavailableError as exc:
        print(f"stageload plot: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # while writing (-o was checked above), as report's full disk
        print(
            f"stageload plot: error: cannot write {args.output!r}: {exc.strerror or exc}; "
            "nothing was written there (an image already there is as it was)",
            file=sys.stderr,
        )
        return EXIT_OUTPUT
    print(f"wrote {out}")
    return 0
