"""``stageload run``: wait for a fair turn in a machine-wide lane, then run under the guard.

A client started with the command in its own command line first hands over (``exec``) to
``python -m stageload run --resume-fd N``, its parsed options on an inherited, unlinked
file: a guard elsewhere whose ``--busy`` pattern matches the command would otherwise take
the waiting client for the engine itself, and the two would wait for each other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import SIZE_HELP, size

#: ``--quiet-for``'s default here: waiting in the queue is the normal case, so a shorter
#: quiet period than the guard's (60 s) after a --busy process was last seen.
QUIET_FOR_DEFAULT = 20.0
#: The hidden flag of the process a client hands over to.
RESUME_FLAG = "--resume-fd"

HELP = "queue a command machine-wide (fair between owners, memory-aware), then guard it"

DESCRIPTION = """\
Join a lane of the machine-wide queue, wait for a fair turn and for room, then run CMD
under the guard (same options and exit codes as 'stageload guard'), metered.

Fairness: of the owners with a waiting command, the one whose latest start in the lane
is the oldest goes next (one who never started first; ties to the older ticket). Each
owner's commands start in the order they were queued. The owner is --owner, else
STAGELOAD_OWNER, else the part of --who before its first dash (sayu-ltx and sayu-rife
are one owner, sayu); --who defaults to STAGELOAD_WHO, else your user name (then the
whole user name is the owner). Only the command whose turn it is may start; the others
wait for it.

Memory: the command whose turn it is starts when nothing runs in the lane, or when
  need <= available - sum over the running commands of max(0, their need - their use now)
where available is what the memory readers report now (cgroup-aware; it already excludes
what the running commands use). need is --memory SIZE, or with 'auto' (default) the
highest peak footprint among the last 5 runs of the same command line in the lane's
history. A command never seen before runs alone: it waits for the lane to empty, and
nothing starts beside it.

Engines started outside the queue: the patterns in STATE/busy.txt, one a line (blank
lines and '#' lines left out), join the --busy of every run in lane 'ram'. --quiet-for
defaults to 20 s here. A waiting client's command line does not hold CMD (it hands its
options over on an inherited file), so no --busy pattern takes it for the engine.

State: ~/.stageload/ (STAGELOAD_HOME to change it), one folder per lane, coordinated with
flock; no daemon. A client killed while waiting leaves nothing behind; one killed while
its command runs takes the command with it (SIGKILL to its group).
Each run's trace goes under lanes/LANE/traces/ (or to --trace; --no-trace for none), with
the command's own StagedModels events (STAGELOAD_TRACE; --no-events to leave them out);
each finished run adds one line to lanes/LANE/history.jsonl. STAGELOAD_QUEUE_POLL sets how
often a waiting client looks (default 0.5s). 'stageload queue' shows the lanes.

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
  STAGELOAD_WHO=sayu-ltx stageload run -- python ltx.py     # owner sayu
  stageload run --lane gpu --start-timeout 2h -- python train.py
"""


def _lane(text: str) -> str:
    from ..guard.queue import check_lane

    try:
        return check_lane(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _who(text: str) -> str:
    from ..guard.queue import check_owner

    try:
        return check_owner(text, "--who", "--who alice-ltx")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _owner(text: str) -> str:
    from ..guard.queue import check_owner

    try:
        return check_owner(text, "--owner", "--owner alice")
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
        type=_who,
        default=None,
        metavar="NAME",
        help="who runs this, e.g. alice-ltx; the part before its first dash is the owner "
        "unless --owner is given (default: $STAGELOAD_WHO, else your user name)",
    )
    queue.add_argument(
        "--owner",
        type=_owner,
        default=None,
        metavar="OWNER",
        help="whose command this is, for fairness (default: $STAGELOAD_OWNER, else the "
        "part of --who before its first dash, else your user name)",
    )
    queue.add_argument(
        "--memory",
        type=_memory,
        default="auto",
        metavar="SIZE|auto",
        help=f"the command's memory need, e.g. 6G: {SIZE_HELP}. 'auto' (default) learns "
        "it from the lane's history, and a command never seen runs alone",
    )
    queue.add_argument(
        "--no-trace",
        dest="keep_trace",
        action="store_false",
        help="write no trace of this run (by default one goes under lanes/LANE/traces/); "
        "its history line then has trace null",
    )
    queue.add_argument(RESUME_FLAG, type=int, default=None, help=argparse.SUPPRESS)
    guard.add_arguments(parser, quiet_for=QUIET_FOR_DEFAULT)


def run(args: argparse.Namespace) -> int:
    from . import EXIT_USAGE
    from .args import command_after_dashes

    if args.resume_fd is not None:
        try:
            args = _resumed(args.resume_fd)
        except ValueError as exc:
            print(f"stageload run: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    command = command_after_dashes(args.command, "stageload run", "stageload run -- python run.py")
    if command is None:
        return EXIT_USAGE
    if args.resume_fd is None and _shown_in_own_command_line(command):
        # Before the guard's imports: the process handed over to imports them anyway, and
        # checks the options (the same messages, from the same pid).
        _hand_over(args)  # returns only if it could not
    from ..guard import GuardSetupError
    from ..guard.runner import run_queued
    from .guard import config_from_args

    try:
        if not args.keep_trace and args.trace is not None:
            raise ValueError(f"--no-trace and --trace {args.trace!r} together: give one of them")
        config = config_from_args(args, command)
        result = run_queued(
            config,
            lane=args.lane,
            owner=args.owner,
            who=args.who,
            memory=args.memory,
            trace=args.keep_trace,
            stderr=sys.stderr,
        )
    except (ValueError, GuardSetupError) as exc:  # e.g. the state directory is not writable
        print(f"stageload run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return result.exit_code


def _shown_in_own_command_line(command: list[str]) -> bool:
    """Whether this process's command line holds ``command``: true for the ``stageload``
    program, false for ``main([...])`` called inside another program (which must not be
    replaced by an exec)."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    n = len(command)
    return any(argv[i : i + n] == command for i in range(len(argv) - n + 1))


def _hand_over(args: argparse.Namespace) -> None:
    """Replace this process (same pid, terminal, signals ignored, parent) by
    ``python -m stageload run --resume-fd N``, the parsed options on file N, unlinked.

    If that cannot be done (no temporary file), say so and return: the run goes on with
    its command in its command line, which only a --busy pattern elsewhere may mistake.
    """
    import tempfile

    options = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    fd = -1
    try:
        data = json.dumps(options).encode()
        with tempfile.TemporaryFile() as file:  # unlinked: nothing is left behind
            file.write(data)
            file.flush()
            fd = os.dup(file.fileno())  # inheritable copy; the file closes on exec
        os.set_inheritable(fd, True)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(
            sys.executable,
            [sys.executable, "-m", "stageload", "run", RESUME_FLAG, str(fd)],
        )
    except (OSError, TypeError, ValueError) as exc:
        if fd >= 0:
            os.close(fd)
        print(
            f"stageload run: warning: could not hide the command from --busy patterns "
            f"elsewhere ({exc}); running with it in this command line",
            file=sys.stderr,
        )


def _resumed(fd: int) -> argparse.Namespace:
    """The options a client handed over on file ``fd`` (``_hand_over``); closes it."""
    try:
        with os.fdopen(fd, "rb") as file:
            file.seek(0)
            options = json.loads(file.read())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{RESUME_FLAG} {fd}: cannot read the options handed over ({exc}); this flag is "
            "for stageload itself, run 'stageload run -- CMD' instead"
        ) from None
    if not isinstance(options, dict) or not isinstance(options.get("command"), list):
        raise ValueError(f"{RESUME_FLAG} {fd}: not the options of a stageload run")
    options[RESUME_FLAG.lstrip("-").replace("-", "_")] = fd
    return argparse.Namespace(**options)
