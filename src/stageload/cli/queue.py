"""``stageload queue``: what runs and what waits in the machine-wide lanes, and the history."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "show what runs and what waits in the machine-wide queue (stageload run)"

DESCRIPTION = """\
Show each lane of the machine-wide queue ('stageload run'): what runs (owner, command,
for how long, memory now against its declared or learned need) and what waits (position,
and why: 'turn' behind another command, 'memory' when its need does not fit beside what
runs, 'busy' when it or a running command runs alone, 'ready' when it starts at its
next look). Tickets of clients that died are removed on the way.

Reads ~/.stageload/ (STAGELOAD_HOME to change it). --json prints one JSON document:
{"state_dir", "time", "lanes": [{"lane", "available", "running": [...],
"waiting": [...], "history": [...]}]}, sizes in bytes, times in seconds (epoch for
'since' and 'start'). docs/queue.md describes every key.

Examples:
  stageload queue
  stageload queue --lane ram --history 10
  stageload queue --json | jq '.lanes[].waiting'
"""


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"invalid --history {text!r}: give a count, e.g. 10")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .run import _lane

    parser.add_argument(
        "--lane", type=_lane, default=None, metavar="NAME", help="show only this lane"
    )
    parser.add_argument(
        "--history",
        type=_count,
        default=0,
        metavar="N",
        help="also show the last N finished runs of each lane",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    from ..guard.board import format_text, snapshot
    from ..guard.queue import QueueSetupError
    from . import EXIT_USAGE

    try:
        doc = snapshot(lane=args.lane, history=args.history)
    except QueueSetupError as exc:
        print(f"stageload queue: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        sys.stdout.write(format_text(doc))
    return 0
