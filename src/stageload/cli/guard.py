"""``stageload guard``: run a command when there is room, stop it before it swaps the machine."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..units import parse_size
from .args import AMOUNT_HELP, SIZE_HELP, amount, command_after_dashes, duration, size

if TYPE_CHECKING:
    from ..guard import GuardConfig

HELP = "run a command only when memory is free, and stop it before it swaps the machine down"

DESCRIPTION = """\
Start CMD only when there is room for it, watch it, and stop it before it takes the
machine down.

Admission: CMD starts once available memory is at least --wait-free, swap used plus
--swap-budget is under --swap-limit (if given), and no process matching a --busy
pattern has been seen for --quiet-for. The quiet period counts from the guard's start,
because it cannot see what ran before. While waiting, the guard says why on stderr.

Watching: the guard stops CMD when swap grows more than --swap-budget over its value
at start, or when available memory stays under --kill-free for two samples in a row.
It samples every --poll seconds, by default adaptively: every 0.5 s, faster (down to
0.1 s) as the margin shrinks.

Stopping: CMD runs in its own process group. The guard sends SIGTERM to that group,
then SIGKILL to whatever is left after --grace. It never signals anything CMD did not
start. SIGINT, SIGTERM or SIGHUP to the guard stop CMD the same way; a second signal
sends SIGKILL at once. Signals ignored when the guard started (nohup) stay ignored.
On Linux, processes that left CMD's group (setsid) are stopped with it. If the guard
itself is killed (kill -9), a watchdog SIGKILLs CMD's group at once.

Exit codes:
  CMD's own       CMD ended by itself (128+N if it died from signal N)
  128+N           the guard got signal N (130 SIGINT, 143 SIGTERM) and stopped CMD
  3               the guard stopped CMD (swap budget or memory floor)
  4               no room before --start-timeout; CMD never started
  127             CMD could not be started
  2               bad command line

Examples:
  stageload guard --wait-free 40% --swap-budget 8G -- python generate.py
  stageload guard --busy 'ffmpeg' --quiet-for 2m --start-timeout 1h -- ./render.sh
  stageload guard --kill-free 4G --trace run.jsonl -- python train.py
"""


def _poll(text: str) -> float | None:
    if text.strip().lower() == "adaptive":
        return None
    seconds = duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(
            f"poll interval must be above 0, got {text!r}: e.g. '0.5s' or 'adaptive'"
        )
    return seconds


def _regex(text: str) -> str:
    from ..guard import compile_busy

    try:
        compile_busy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser, quiet_for: float = 60.0) -> None:
    """The guard's options; ``quiet_for`` is ``--quiet-for``'s default (``stageload run``'s
    is shorter)."""
    admit = parser.add_argument_group("admission")
    admit.add_argument(
        "--wait-free",
        type=amount,
        default="40%",
        metavar="AMOUNT",
        help=f"start only when available memory is at least this: {AMOUNT_HELP} (default: 40%%)",
    )
    admit.add_argument(
        "--swap-limit",
        type=size,
        default=None,
        metavar="SIZE",
        help=f"start only when swap used plus --swap-budget stays under this size: {SIZE_HELP}",
    )
    admit.add_argument(
        "--busy",
        type=_regex,
        action="append",
        default=[],
        metavar="REGEX",
        help="wait while a process whose full command line matches REGEX runs "
        "(repeatable; the guard and its ancestors are left out)",
    )
    admit.add_argument(
        "--quiet-for",
        type=duration,
        default=quiet_for,
        metavar="DURATION",
        help=f"how long no --busy process must be seen before starting (default: {quiet_for:g} s)",
    )
    admit.add_argument(
        "--start-timeout",
        type=duration,
        default=None,
        metavar="DURATION",
        help="give up after waiting this long, with exit code 4 (default: wait forever)",
    )
    watch = parser.add_argument_group("watching and stopping")
    watch.add_argument(
        "--swap-budget",
        type=size,
        default=parse_size("8G"),
        metavar="SIZE",
        help="stop the command when swap grows more than this over its value at start: "
        f"{SIZE_HELP} (default: 8G)",
    )
    watch.add_argument(
        "--kill-free",
        type=amount,
        default="10%",
        metavar="AMOUNT",
        help="stop the command when available memory stays under this for two samples in "
        f"a row: {AMOUNT_HELP} (default: 10%%)",
    )
    watch.add_argument(
        "--poll",
        type=_poll,
        default=None,
        metavar="DURATION",
        help="seconds between samples (default: adaptive, 0.5 s down to 0.1 s as the "
        "margin shrinks)",
    )
    watch.add_argument(
        "--grace",
        type=duration,
        default=5.0,
        metavar="DURATION",
        help="time between SIGTERM and SIGKILL when stopping (default: 5s)",
    )
    watch.add_argument(
        "--leave-group",
        action="store_true",
        help="when the command exits by itself, leave the processes it started in its "
        "group running (default: stop them, SIGTERM then SIGKILL after --grace)",
    )
    watch.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="write a meter trace (JSONL) of the command's process tree, with the "
        "guard's decisions as events and the command's own stageload events (stages, "
        "loads, releases of every StagedModels in it)",
    )
    watch.add_argument(
        "--no-events",
        dest="events",
        action="store_false",
        help="keep the command's own stageload events out of the trace; the same as "
        "STAGELOAD_EVENTS=0",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the command to run, after '--'",
    )


def config_from_args(args: argparse.Namespace, command: list[str]) -> GuardConfig:
    """The ``GuardConfig`` the guard options in ``args`` describe (``stageload run`` takes
    the same options). ``ValueError`` for flags that are each fine but not together."""
    from ..guard import GuardConfig

    return GuardConfig(
        command,
        wait_free=args.wait_free,
        swap_limit=args.swap_limit,
        swap_budget=args.swap_budget,
        busy=args.busy,
        quiet_for=args.quiet_for,
        start_timeout=args.start_timeout,
        kill_free=args.kill_free,
        poll=args.poll,
        grace=args.grace,
        trace=args.trace,
        events=args.events,
        leave_group=args.leave_group,
    )


def run(args: argparse.Namespace) -> int:
    from ..guard import GuardSetupError, run_guard
    from . import EXIT_USAGE

    command = command_after_dashes(
        args.command, "stageload guard", "stageload guard -- python run.py"
    )
    if command is None:
        return EXIT_USAGE
    try:
        config = config_from_args(args, command)
    except ValueError as exc:  # flags that are each fine but cannot work together
        print(f"stageload guard: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run_guard(config, stderr=sys.stderr).exit_code
    except GuardSetupError as exc:  # e.g. the --trace file cannot be written; nothing ran
        print(f"stageload guard: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
