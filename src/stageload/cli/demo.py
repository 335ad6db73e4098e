"""``stageload demo``: run a built-in three-stage pipeline eager and staged, and compare."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .args import interval, unusable_folder

_THREADS_MAX = 4096

HELP = "run a built-in 3-model pipeline eager and staged; compare memory per stage and outputs"
DESCRIPTION = """\
Build a small three-stage pipeline (encoder -> denoiser loop -> decoder) with real weights:
three models of a few hundred MB each, generated once from a fixed seed and saved as
safetensors in ~/.cache/stageload/demo (or $XDG_CACHE_HOME/stageload/demo). Run it twice,
each time in a fresh process under MemoryMeter with torch threads pinned to the same number:

  eager   every model loaded at setup and kept to the end
  staged  StagedModels loads each model when its stage asks, releases it after

The pipeline seeds once and draws noise in every stage right after fetching its model, so
only RNG preservation keeps the staged output equal to the eager one: the demo checks
that they are identical bit for bit, prints the per-stage report and writes the plot.

Written to the output folder: eager.jsonl and staged.jsonl (traces), the two outputs
(*.safetensors), demo.png (memory over time, peak per stage) and demo.json.

examples:
  stageload demo
  stageload demo -o /tmp/demo --json
  stageload demo --size small        # a few MB per model, seconds

exit codes: 0 outputs identical, 1 outputs differ, 2 bad usage, 3 a run failed.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--output", default="stageload-demo", metavar="DIR",
        help="folder for traces, outputs and the plot (default: ./stageload-demo)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--size", choices=("small", "default"), default="default",
        help="default: 832 MiB of weights, 20-60 s; small: a few MB, seconds",
    )  # fmt: skip
    parser.add_argument(
        "--interval", type=interval, default=0.1, metavar="S",
        help="seconds between memory samples (default: 0.1)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=None, metavar="N",
        help="torch threads in both runs (default: min(2, CPUs))",
    )  # fmt: skip
    parser.add_argument(
        "--cache", type=Path, default=None, metavar="DIR",
        help="where the generated weights are kept (default: ~/.cache/stageload/demo)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..demo import (
        EXIT_DIFFERENT,
        EXIT_OK,
        EXIT_RUN_FAILED,
        DemoRunError,
        format_result,
        run_demo,
    )

    if args.threads is not None and args.threads < 1:
        print(f"stageload demo: error: --threads must be at least 1, got {args.threads!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.threads is not None and args.threads > _THREADS_MAX:
        # torch takes a C int (a larger one is an overflow deep in the run), and far more
        # threads than cores only slow it down.
        shown = str(args.threads)
        shown = shown if len(shown) <= 24 else f"{shown[:12]}... ({len(shown)} digits)"
        print(f"stageload demo: error: --threads must be at most {_THREADS_MAX}, got {shown}; "
              "e.g. --threads 2", file=sys.stderr)  # fmt: skip
        return 2
    # Checked now rather than as an OSError halfway, which would read as a failed run (3).
    for flag, folder in (("-o", args.output), ("--cache", args.cache)):
        problem = None if folder is None else unusable_folder(folder)
        if problem is not None:
            print(f"stageload demo: error: {flag}: {problem}", file=sys.stderr)
            return 2

    # Progress goes to stderr, so stdout holds only the report (or the JSON).
    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        result = run_demo(
            Path(args.output),
            size=args.size,
            interval=args.interval,
            threads=args.threads,
            cache=args.cache,
            progress=progress,
        )
    except DemoRunError as exc:
        print(f"stageload demo: error: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except OSError as exc:
        print(f"stageload demo: error: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_result(result))
    return EXIT_OK if result.identical else EXIT_DIFFERENT
