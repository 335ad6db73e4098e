"""``stageload run``: wait for a fair turn in a machine-wide lane, then run under the guard."""

from __future__ import annotations

import argparse
import sys

from ._args import size

HELP = "queue a command machine-wide (fair between owners, memory-aware), then guard it"

DESCRIPTION = """\
Join a lane of the machine-wide queue, wait for a fair turn and for room, then run CMD
under the guard (same options and exit codes as 'stageload guard'), metered.

Fairness: of the owners with a waiting command, the one whose latest start in the lane
is the oldest goes next (one who never started first; ties to the older ticket). Each
owner's commands start in the order they were queued. --who defaults to your user name.
Only the command whose turn it is may start; the others wait for it.

Memory: the command whose turn it is starts when nothing runs in the lane, or when
  need <= available - sum over the running commands of max(0, their need - their use now)
where available is what the memory readers report now (cgroup-aware; it already excludes
what the running commands use). need is --memory SIZE, or with 'auto' (default) the
highest peak footprint among the last 5 runs of the same command line in the lane's
history. A command never seen before runs alone: it waits for the lane to empty, and
nothing starts beside it.

State: ~/.stageload/ (STAGELOAD_HOME to change it), one folder per lane, coordinated with
flock; no daemon. A client killed while waiting leaves nothing behind; one killed while
its command runs takes the command with it (SIGKILL to its group).
Each run's trace goes under lanes/LANE/traces/ (or to --trace), with the command's own
StagedModels events (STAGELOAD_TRACE; --no-events to leave them out); each finished run adds
one line to lanes/LANE/history.jsonl. STAGELOAD_QUEUE_POLL sets how often a waiting
client looks (default 0.5s). 'stageload queue' shows the lanes.

Exit codes:
  CMD's own       CMD ended by itself (128+N if it died from signal N)
  128+N           got signal N while waiting or running (the command is stopped)
  3               the guard stopped CMD (swap budget or memory floor)
  4               no turn or no room before --start-timeout (covers both waits)
  127             CMD could not be started
  2               bad command line, or the state directory cannot be used

Examples:
  stageload run -- python generate.py
  stageload run --memory 12G --who nightly -- ./render.sh
  stageload run --lane gpu --start-timeout 2h -- python train.py
"""


def _lane(text: str) -> str:
    from ..guard.queue import check_lane

    try:
        return check_lane(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _owner(text: str) -> str:
    from ..guard.queue import check_owner

    try:
        return check_owner(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _memory(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return size(text)
    except argparse.ArgumentTypeError as exc:
        if "too large" in str(exc):
            raise argparse.ArgumentTypeError(f"invalid --memory: {exc}") from None
        raise argparse.ArgumentTypeError(
            f"invalid --memory {text!r}: give a size such as '6G' or '512M', or 'auto' to "
            "use the peak learned from the lane's history"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from . import guard

    queue = parser.add_argument_group("queue")
    queue.add_argument(
        "--lane",
        type=_lane,
        default="ram",
        metavar="NAME",
        help="the lane to join: commands in one lane queue together (default: ram)",
    )
    queue.add_argument(
        "--who",
        type=_owner,
        default=None,
        metavar="OWNER",
        help="whose command this is, for fairness (default: your user name)",
    )
    queue.add_argument(
        "--memory",
        type=_memory,
        default="auto",
        metavar="SIZE|auto",
        help="the command's memory need, e.g. 6G; 'auto' (default) learns it from the "
        "lane's history, and a command never seen runs alone",
    )
    guard.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ..guard import GuardSetupError
    from ..guard.runner import run_queued
    from . import EXIT_USAGE
    from ._args import command_after_dashes
    from .guard import config_from_args

    command = command_after_dashes(args.command, "stageload run", "stageload run -- python run.py")
    if command is None:
        return EXIT_USAGE
    try:
        config = config_from_args(args, command)
        result = run_queued(
            config, lane=args.lane, owner=args.who, memory=args.memory, stderr=sys.stderr
        )
    except (ValueError, GuardSetupError) as exc:  # e.g. the state directory is not writable
        print(f"stageload run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return result.exit_code
