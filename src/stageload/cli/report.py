"""``stageload report``: per-stage tables that compare traces, or their JSON."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "compare traces per stage: peak footprint, time, swap, loads and releases"
DESCRIPTION = """\
Summarise one or more traces as a table: one row per stage, one column per trace
(headed by the trace's meta label, or its file name), then rows about each whole run:
peak footprint, swap at start/peak/end and its growth, lowest available memory, and the
loads, reloads and releases with their bytes and seconds.

A stage's window starts once the releases that entering it triggered have finished, so
memory still being freed counts toward the stage before. A stage a trace never reached
shows '-'.

A command's own StagedModels events reach the trace of 'stageload meter' and
'stageload guard --trace' (docs/trace-format.md). When more than one process of the
command emitted pipeline events, each gets its own column, headed 'LABEL [pid N]': the
stages are that process's, the memory is the whole tree's.

examples:
  stageload report eager.jsonl staged.jsonl
  stageload report run.jsonl --json | jq '.traces[0].stages'

exit codes: 0 ok, 1 the report cannot be written (e.g. a full disk), 2 a file is
missing or is not a trace.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="JSONL trace files")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    from ..report.processes import load_views
    from ..report.records import TraceError
    from ..report.tables import format_report, report_dict
    from ..report.trace import summarize

    try:
        # A trace with events from several processes gives one column per process.
        summaries = [summarize(view) for view in load_views(args.traces)]
    except TraceError as exc:
        print(f"stageload report: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report_dict(summaries), indent=2))
    else:
        print(format_report(summaries))
    return 0
