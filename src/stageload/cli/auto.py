"""``stageload auto``: run an unmodified Python script with staged loading (``stageload.auto``)."""

from __future__ import annotations

import argparse
import atexit
import builtins
import importlib.machinery
import importlib.util
import io
import os
import pkgutil
import runpy
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .args import command_after_dashes

HELP = "run an unmodified Python script with its models loaded and released by stage"

DESCRIPTION = """\
Run SCRIPT in this process with stageload.auto() on: the models it makes through
diffusers' and transformers' from_pretrained (and each --factory) load at their first call
and are released to 'meta' when the next one would not fit the budget: the least recently
used first; once the script's sequence of models repeats, the one used furthest ahead,
and the next models load ahead in a background thread while the current one computes
(those that reload from their files). Seeded scripts give the results they give without
it, bit for bit.

The command is a Python script or module: 'python script.py ARGS', 'script.py ARGS',
'python folder ARGS' (its __main__.py) or 'python -m module ARGS'. Other python
options are not taken (the script runs in this interpreter). What auto cannot stage it
says on stderr as it finds it, one line each ('stageload auto: ...': a model kept loaded,
and why); under 'stageload meter', the loads and releases go into the trace too.

Examples:
  stageload auto -- python generate.py --prompt "a cat"
  stageload auto --budget 12G --factory mypkg.models:load_model -- python run.py
  stageload meter -o run.jsonl -- stageload auto -- python generate.py

A --factory must be importable without running the script: a function defined in the
script itself is refused (move it to a module the script imports).

Exit codes: the script's own (SystemExit), 1 if it raised, 2 for bad usage; on Ctrl-C, the
process ends by SIGINT, as python's does (a shell says 130).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help="memory the models may hold: bytes, e.g. '12G', '80%%' or 'auto' "
        "(default: the memory available when the script starts)",
    )
    parser.add_argument(
        "--factory",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="another function or classmethod that makes a model, e.g. "
        "mypkg.models:load_model or mypkg:Net.load (repeatable)",
    )
    parser.add_argument(
        "--no-defaults",
        action="store_true",
        help="wrap only the --factory ones, not diffusers' and transformers' from_pretrained",
    )
    parser.add_argument(
        "--no-prefetch",
        action="store_true",
        help="load no model ahead: every reload at its use, on the script's thread",
    )
    parser.add_argument(
        "--no-share",
        action="store_true",
        help="identical factory calls each make their own model, as without auto (default: "
        "they get one model; a script that changes one of two copies needs this)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python SCRIPT [ARGS]")


#: The first bytes of a compiled program: ELF (Linux), Mach-O 64-bit and universal (macOS).
_PROGRAMS = (b"\x7fELF", b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe")


def _target(command: list[str]) -> tuple[str, str, list[str]] | str:
    """("path" or "module", what, its argv) from the command, or why it cannot run here."""
    words = list(command)
    if Path(words[0]).name.startswith("python") and not words[0].endswith(".py"):
        words = words[1:]
        if not words:
            return "no script after python"
        if words[0] == "-m":
            if len(words) < 2:
                return "-m needs a module name"
            if words[1].startswith("."):
                return f"-m takes no relative module name ({words[1]!r}), as python's does not"
            return "module", words[1], [words[1], *words[2:]]
        if words[0].startswith("-"):
            return (
                f"python option {words[0]!r} is not taken: the script runs in this "
                f"interpreter; give only the script and its arguments"
            )
    if os.path.isdir(words[0]):  # as python runs a folder: its __main__.py
        if not os.path.isfile(os.path.join(words[0], "__main__.py")):
            return f"no __main__.py in the folder {words[0]!r} (python runs that one)"
        return "path", words[0], words
    if not os.path.isfile(words[0]):
        if shutil.which(words[0]) is not None:  # -- bash run.sh
            return (
                f"{words[0]!r} is a program, not python; stageload auto runs a Python "
                f"script in this interpreter: -- python script.py [args]"
            )
        return (
            f"no script {words[0]!r}; stageload auto runs a Python script in this "
            f"interpreter: -- python script.py [args] or -- python -m module [args]"
        )
    try:
        with open(words[0], "rb") as f:
            head = f.readline(256)
    except OSError as exc:
        return f"cannot read the script {words[0]!r}: {exc.strerror or exc}"
    if head[:4] in _PROGRAMS:  # /usr/bin/env: python would read it as source
        return (
            f"{words[0]!r} is a program, not a Python script; stageload auto runs a "
            f"script in this interpreter: -- python script.py [args]"
        )
    if head.startswith(b"#!") and b"python" not in head:  # a shell script, run as Python
        return (
            f"{words[0]!r} starts with {head.decode(errors='replace').strip()!r}: not a "
            f"Python script; stageload auto runs a script in this interpreter: "
            f"-- python script.py [args]"
        )
    return "path", words[0], words


def _other_python(word: str) -> str | None:
    """The interpreter the command names, where it is not this one's (another folder:
    the system's python, another virtual environment): the script runs in this one."""
    if not Path(word).name.startswith("python") or word.endswith(".py"):
        return None
    named = shutil.which(word)
    if named is None or os.path.dirname(os.path.abspath(named)) == os.path.dirname(
        os.path.abspath(sys.executable)
    ):
        return None
    return named


def run(args: argparse.Namespace) -> int:
    from ..autostage import AutoError, auto, uncalled_note
    from ..memory.budget import over_memory, parse_budget
    from . import EXIT_USAGE

    command = command_after_dashes(
        args.command, "stageload auto", "stageload auto -- python script.py"
    )
    if command is None:
        return EXIT_USAGE
    target = _target(command)
    if args.no_defaults and not args.factory:
        target = (
            "--no-defaults with no --factory stages nothing: name the factories to wrap "
            "(--factory module:function), or leave out --no-defaults"
        )
    if isinstance(target, str):
        print(f"stageload auto: error: {target}", file=sys.stderr)
        return EXIT_USAGE
    kind, what, argv = target
    other = _other_python(command[0])
    if other is not None:  # its packages may differ: say which one runs it
        print(
            f"stageload auto: warning: the script runs in this interpreter, "
            f"{sys.executable}, not {other}",
            file=sys.stderr,
        )
    saved_argv, saved_path = sys.argv, list(sys.path)
    # As python sets them for the script, before the factories are looked up: sys.path[0]
    # is the script's folder (or the working directory for -m), in place of this
    # command's own, so a factory in the script's package imports from there.
    sys.argv = argv
    path0 = _path0(what) if kind == "path" else ""
    importable = kind == "path" and pkgutil.get_importer(path0) is not None
    if importable:  # a folder or zip file run by its __main__: python adds it even with -P
        if sys.flags.safe_path:
            sys.path.insert(0, path0)
        else:
            sys.path[0] = path0
    elif not sys.flags.safe_path:  # python -P adds no folder: sys.path[0] is PYTHONPATH's
        if kind == "module":
            sys.path[0] = os.getcwd()
        else:  # the script's real folder: python follows a link to the script
            sys.path[0] = os.path.dirname(os.path.realpath(what))
    if kind == "module" and importlib.util.find_spec(what.partition(".")[0]) is None:
        # Its top-level package only: finding a submodule imports its parents, which may
        # load models before auto is on.
        sys.argv, sys.path[:] = saved_argv, saved_path
        print(
            f"stageload auto: error: no module {what.partition('.')[0]!r} to run with -m "
            f"on this python's path; check its name, or cd to the folder that holds it",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        for spec in args.factory:
            _not_the_script(spec, kind, what)
        said = _SaidOnStderr()
        over = over_memory(parse_budget(args.budget)) if args.budget is not None else None
        if over is not None:
            print(f"stageload auto: warning: {over}", file=sys.stderr)
        session = auto(
            budget=args.budget,
            factories=args.factory,
            defaults=not args.no_defaults,
            prefetch=not args.no_prefetch,
            share=not args.no_share,
            events=said,
        )
        staging = session.__enter__()
    except (AutoError, ValueError, TypeError) as exc:
        sys.argv, sys.path[:] = saved_argv, saved_path
        print(f"stageload auto: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # auto stays on until the interpreter exits: it joins the script's non-daemon threads
    # (and stops idle pool workers) first, as for the script alone, then runs this.
    atexit.register(session.__exit__, None, None, None)
    code = 0
    try:
        if importable:
            _run_importable()
        elif kind == "path":
            _run_script(what)
        else:
            runpy.run_module(what, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        from . import INTERRUPTED

        _print_error()
        code = INTERRUPTED
    except BaseException:  # noqa: BLE001  the script's error, printed as python would
        _print_error()
        code = 1
    said.on = False  # the end of the block's notes: the warning below, or the error above
    if code == 0:  # said once the script's threads are done too (a failed run says why)
        atexit.register(_warn_uncalled, staging, uncalled_note)
    return code


class _SaidOnStderr:
    """auto's notes on stderr while the script runs, each once as auto says it: a model it
    keeps loaded and why (run without torch.no_grad(), over the budget alone, changed by
    the script). Without them a script that saved no memory said nothing, outside
    'stageload meter'. Any thread may emit (loads ahead). A stderr nobody reads any more
    (``2>&1 | head``) stops the notes, not the script: auto emits inside its loads and
    releases, where an error would have ended the run."""

    def __init__(self) -> None:
        self.on = True

    def emit(self, event: Any) -> None:
        if self.on and event.kind == "note" and event.note:
            try:
                print(f"stageload auto: {event.note}", file=sys.stderr, flush=True)
            except (OSError, ValueError):  # a closed pipe or file: the script goes on
                self.on = False


def _path0(typed: str) -> str:
    """The path python makes of the script, folder or zip file ``typed`` (Python/main.c,
    ``_Py_abspath``): the working folder joined to it, unnormalised and links not followed
    (``./app`` is ``/home/me/./app``). A folder's or zip file's is its ``sys.path[0]``."""
    return typed if os.path.isabs(typed) else os.path.join(os.getcwd(), typed)


def _run_importable() -> None:
    """Run the folder or zip file at ``sys.path[0]`` as ``python typed`` runs it: runpy's
    ``_run_module_as_main("__main__", alter_argv=False)``, which python itself calls for
    one (Modules/main.c, ``pymain_run_module``), in a new ``__main__`` module. Through
    ``runpy.run_path`` the script saw the absolute path as ``sys.argv[0]``, where python
    gives it as typed, a normalised ``__file__`` and ``sys.path[0]`` (``./app`` was
    ``/home/me/app``), and its folder twice on ``sys.path``; and a zip file was read as
    source. With no ``__main__`` there it exits with python's message."""
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module  # runpy runs the code in __main__'s own namespace
    try:
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _run_script(typed: str) -> None:
    """Run the script file ``typed`` as ``python typed`` runs it, with ``sys.argv`` already
    the script's. ``runpy.run_path`` sets ``sys.argv[0]`` to the path it is given, so given
    an absolute one (for ``__file__``), the script saw ``/home/me/x.py`` where python gives
    ``x.py`` as typed. Here ``__file__`` and the code's file name are the working folder
    joined to ``typed``, unnormalised (python: ``./x.py`` is ``/home/me/./x.py``), and the
    script is ``__main__`` in ``sys.modules`` while it runs, as with ``run_path``."""
    path = _path0(typed)
    with io.open_code(path) as file:
        code = pkgutil.read_code(file)  # a compiled .pyc, which python runs too
    if code is None:
        with io.open_code(path) as file:
            code = compile(file.read(), path, "exec", dont_inherit=True)
        loader: Any = importlib.machinery.SourceFileLoader("__main__", path)
    else:
        loader = importlib.machinery.SourcelessFileLoader("__main__", path)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=path, __cached__=None, __loader__=loader, __package__=None, __spec__=None
    )
    module.__dict__["__builtins__"] = builtins
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _print_error() -> None:
    """The exception being handled, as python prints a script's: through ``sys.excepthook``
    (the script's own, if it set one: rich's, a logger's), from the script's first frame
    (without this command's and runpy's)."""
    kind, value, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_globals.get("__name__") != "__main__":
        tb = tb.tb_next
    if value is not None:  # the default hook prints the exception's own traceback
        value.__traceback__ = tb
    sys.excepthook(kind, value, tb)  # type: ignore[arg-type]


def _warn_uncalled(staging: Any, note: Callable[[str], str]) -> None:
    """At exit, once the script's threads are done (the interpreter joins them before it
    runs exit handlers): the factories named with --factory that nothing called."""
    for spec in staging.uncalled():
        print(f"stageload auto: warning: {note(spec)}", file=sys.stderr)


def _not_the_script(spec: str, kind: str, what: str) -> None:
    """Raise AutoError when ``--factory`` names the script itself: importing it would run
    the whole script once, unstaged, before the real run (whose functions, in __main__,
    are not the ones wrapped)."""
    from ..autostage import AutoError

    module = spec.partition(":")[0]
    if kind == "module":  # python -m pkg runs pkg.__main__ (or the module pkg itself)
        same = module in (what, f"{what}.__main__")
    else:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return  # auto() says it cannot import it
        origin = getattr(found, "origin", None)
        script = _script_file(what)
        try:
            same = origin is not None and script is not None and os.path.samefile(origin, script)
        except OSError:  # "built-in", "frozen", a file in a zip file: not a file
            same = origin == script
    if same:
        raise AutoError(
            f"factory {spec!r} is in the script itself, which would run once unstaged to "
            f"find it; move the function to a module the script imports, and name that"
        )


def _script_file(typed: str) -> str | None:
    """The file python runs for ``typed``: the script itself, or a folder's or zip file's
    ``__main__`` as runpy finds it there (the folder itself matched no module's file, and
    a factory in its ``__main__.py`` ran the whole script once, unstaged)."""
    importer = pkgutil.get_importer(_path0(typed))
    if importer is None:
        return typed
    spec = importer.find_spec("__main__")  # type: ignore[union-attr]
    return getattr(spec, "origin", None)
