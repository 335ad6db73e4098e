"""The ``stageload`` command: argparse subcommands over the library, each returning an exit code.

One module per subcommand sits beside this one. Each defines ``HELP`` (one line),
``DESCRIPTION`` (the ``--help`` text), ``add_arguments(parser)`` and ``run(args) -> int``, and
imports nothing heavy at import time: ``stageload --help`` loads all of them.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from .._version import __version__

# Subcommand name -> module in stageload.cli. Order is the order in --help.
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "meter": "meter",
    "report": "report",
    "plot": "plot",
    "guard": "guard",
    "run": "run",
    "queue": "queue",
    "auto": "auto",
}

#: Exit code for bad command-line usage, as argparse uses.
EXIT_USAGE = 2


class Interrupted(int):
    """The exit code (130) of a script that ``stageload auto`` ran and Ctrl-C ended:
    :func:`entry` then ends the process by SIGINT, as python does for it. A shell loop
    (``for f in *.py; do stageload auto -- python "$f"; done``) stops at a Ctrl-C only for a
    child the signal killed; an exit code of 130 let it run the next one."""


#: The one instance: what ``stageload auto`` returns for its script's Ctrl-C.
INTERRUPTED = Interrupted(130)

# Commands whose output is the point, with what it is called in an error: a reader that
# went away (`stageload report | head`) took what it wanted, so a broken pipe is a success
# for them and for them only; any other failure to write it is an error (exit 1).
_OUTPUT_COMMANDS = {"report": "the report", "queue": "the queue's state"}
#: Exit code when the output of ``report`` or ``queue``, or ``plot``'s image, cannot be
#: written.
EXIT_OUTPUT = 1
# Commands that run a command and exit with its code: their stderr never fails them
# (`stageload guard -- CMD 2>&1 | true` exits with CMD's code, not 0 or 1).
_COMMAND_RUNNERS = frozenset({"guard", "meter", "run", "auto"})


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an unknown flag is reported here, with this command's usage,
    rather than passed up to the top-level parser, which would print its own."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        # argparse takes a value that starts with '-' for a flag (`--who -x`, a name the
        # queue accepts) and says only "expected one argument"; '=' is how to give it.
        missing = _ONE_ARGUMENT.fullmatch(message)
        if missing:
            flag = missing.group(1).split("/")[-1]
            message += f"; a value that starts with '-' goes after '=', e.g. {flag}=-x"
        super().error(message)


# argparse's message for a flag given without its value: "argument --who: expected one
# argument" ("-o/--output" for a flag with two names).
_ONE_ARGUMENT = re.compile(r"argument (\S+): expected one argument")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stageload",
        description="Staged model loading for multi-stage PyTorch pipelines, with memory "
        "traces and a guard that keeps heavy runs from swapping the machine down.",
        epilog="Run 'stageload COMMAND --help' for a command's options, examples and exit "
        "codes. Start with 'stageload demo'. The Python API (StagedModels, release, "
        "MemoryMeter, ...) is in the README.",
    )
    parser.add_argument("--version", action="version", version=f"stageload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"stageload.cli.{module_name}")
        cmd = sub.add_parser(
            name,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run, _name=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the subcommand, and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    stderr, stdout = sys.stderr, sys.stdout
    if args._name in _COMMAND_RUNNERS:
        from ._stderr import QuietStream

        sys.stderr = QuietStream(stderr)  # type: ignore[assignment]
    from ._stdout import CheckedStream, OutputError

    if args._name in _OUTPUT_COMMANDS:
        sys.stdout = CheckedStream(stdout)  # type: ignore[assignment]
    try:
        code = args._run(args)
        code = code if isinstance(code, Interrupted) else int(code)
        if args._name in _OUTPUT_COMMANDS:
            sys.stdout.flush()  # a full disk fails here, not in the interpreter's last flush
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`stageload report --json | head`).
        _stdout_to_devnull()
        return 0 if args._name in _OUTPUT_COMMANDS else 1
    except OutputError as exc:  # `stageload report t.jsonl > /dev/full`
        _stdout_to_devnull()
        what = _OUTPUT_COMMANDS[args._name]
        print(f"stageload {args._name}: error: cannot write {what}: {exc}", file=stderr)
        return EXIT_OUTPUT
    finally:
        sys.stderr, sys.stdout = stderr, stdout


def _stdout_to_devnull() -> None:
    """Point stdout at devnull, so the interpreter's final flush of what is still buffered
    does not fail again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def entry() -> None:
    """The ``stageload`` command: :func:`main`, exiting as python would. A script that
    ``stageload auto`` ran and Ctrl-C ended ends this process by SIGINT, after the atexit
    handlers (its error already printed): the parent sees what it sees of ``python``."""
    code = main()
    if isinstance(code, Interrupted):
        # An unhandled KeyboardInterrupt makes the interpreter end by the signal itself,
        # once finalized (CPython since 3.8).
        sys.excepthook = lambda *exc: None
        raise KeyboardInterrupt
    sys.exit(code)


if __name__ == "__main__":
    entry()
