"""The machine-wide queue's state: lanes in a folder, and tickets held by live clients.

The two rules that decide who starts (fairness between owners, memory) are in ``rules``.

There is no daemon. Each lane is a folder under the state directory (``~/.stageload/`` or
``$STAGELOAD_HOME``)::

    lanes/<lane>/lock           flock'ed (LOCK_EX) for every read-decide-write of the lane
    lanes/<lane>/seq            the last ticket number given out
    lanes/<lane>/owners.json    owner -> wall time of their latest start in the lane
    lanes/<lane>/tickets/N.json one per client, flock'ed by that client while it lives
    lanes/<lane>/history.jsonl  one line per finished run (``history``)
    lanes/<lane>/traces/        the runs' meter traces
    busy.txt                    --busy patterns added to every run of the ``ram`` lane

Everything read from these files is data, checked before use (``Ticket._check``,
``history.check_record``): a value out of range (a ``seq`` of 400 digits, a time of 1e300,
a need above ``SIZE_MAX``) or a document nested too deeply is skipped and counted in
``Lane.skipped``, never a traceback and never a figure.

A client holds ``LOCK_EX`` on its own ticket's open file for as long as it lives; the
kernel drops that lock when the process dies, however it dies. Whoever reads the lane
(another client, ``stageload queue``) does so under the lane lock and treats a ticket whose
lock it can take as dead and removes it, so a client killed with SIGKILL leaves nothing
that holds up the others. A client's command dies with it (the guard's watchdog, see
``process``). Should it still run (the watchdog was killed too), its ticket stays, marked
``orphaned``, with its need counted, until that command ends: a safety net kept for that
case, at the cost of one pid check per dead ticket. A ticket is created and locked under the lane
lock, so no reader sees one that is not locked yet.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from ..errors import StageloadError
from ..units import SIZE_MAX

#: Environment variable that moves the state directory from ``~/.stageload``.
HOME_ENV = "STAGELOAD_HOME"
#: Environment variable for how often a waiting client looks again (a duration).
POLL_ENV = "STAGELOAD_QUEUE_POLL"
#: Default seconds between a waiting client's looks at its lane.
POLL_DEFAULT = 0.5
#: The lane ``stageload run`` joins unless told otherwise.
DEFAULT_LANE = "ram"
#: Environment variable for the owner of a run when ``--owner`` is not given.
OWNER_ENV = "STAGELOAD_OWNER"
#: Environment variable for ``--who`` when it is not given.
WHO_ENV = "STAGELOAD_WHO"
#: File in the state directory whose patterns join the ``--busy`` of every run in
#: ``BUSY_LANE``: engines started outside the queue, that every session waits for.
BUSY_FILE = "busy.txt"
#: The lane ``BUSY_FILE`` applies to.
BUSY_LANE = DEFAULT_LANE
#: Ticket numbers are file names of 12 digits; a ``seq`` above this is damage.
SEQ_MAX = 10**12 - 1
#: Highest process id a ticket may name (``pid_t`` is 32-bit signed).
PID_MAX = 2**31 - 1
#: How far past now a recorded wall time may lie (clock steps) before it is damage.
CLOCK_SLACK = 86400.0

_LANE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# ASCII digits only: str.isdigit() also takes '²', which int() refuses.
_TICKET_NUMBER = re.compile(r"[0-9]{1,12}")
_TICKET_NAME = re.compile(r"([0-9]{1,12})\.json")

NeedSource = Literal["declared", "learned", "unknown"]


class QueueSetupError(StageloadError):
    """The state directory or a lane cannot be used; nothing was queued or run."""


def check_lane(name: str) -> str:
    """``name`` if it is a valid lane name, else ``ValueError`` saying what is allowed."""
    if not isinstance(name, str) or not _LANE_RE.fullmatch(name):
        raise ValueError(
            f"invalid lane name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, e.g. 'ram' or 'gpu-0'"
        )
    return name


def check_owner(name: str, what: str = "owner", example: str = "--who alice") -> str:
    """``name`` if it is a usable owner name (printable, 1-64 characters), else ValueError
    naming ``what`` was given (the flag or variable) and an ``example``."""
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isprintable():
        raise ValueError(f"invalid {what} {name!r}: give 1-64 printable characters, e.g. {example}")
    return name


def resolve_owner(
    owner: str | None = None, who: str | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """``(owner, who)`` of a run: ``who`` is ``who``, else ``$STAGELOAD_WHO``, else the user
    name; the owner (who fairness counts) is ``owner``, else ``$STAGELOAD_OWNER``, else the
    part of a given ``who`` before its first dash (``sayu-ltx`` and ``sayu-rife`` are one
    owner, ``sayu``), else the whole user name. ``ValueError`` names a bad value's source;
    a variable set but empty is an error, not a silent fallback."""
    env = os.environ if environ is None else environ

    def from_env(name: str) -> str | None:
        value = env.get(name)
        if value is not None and not value.strip():
            raise ValueError(
                f"{name} is set but empty ({value!r}); set it to a name, e.g. {name}=alice, "
                "or unset it"
            )
        return value

    who_what, who_example = "--who", "--who alice-ltx"
    if who is None and (who := from_env(WHO_ENV)) is not None:
        who_what, who_example = WHO_ENV, f"{WHO_ENV}=alice-ltx"
    owner_what, owner_example = "--owner", "--owner alice"
    if owner is None and (owner := from_env(OWNER_ENV)) is not None:
        owner_what, owner_example = OWNER_ENV, f"{OWNER_ENV}=alice"
    if who is None:
        who = default_owner()
        if owner is None:
            owner = who  # a user name is one owner, dashes and all
    elif owner is None:
        owner = who.split("-", 1)[0] or who  # '-x' has no part before its dash
    check_owner(who, who_what, who_example)
    check_owner(owner, owner_what, owner_example)
    return owner, who


def busy_patterns(home: str | os.PathLike[str] | None = None) -> list[str]:
    """The patterns in the state directory's ``busy.txt``, one a line (blank lines and
    lines starting with ``#`` are left out); [] when there is no such file.

    ``QueueSetupError`` naming the file and line when a pattern is not a regular
    expression: a run that silently left it out would start beside the engine it names.
    """
    from .config import compile_busy

    path = state_dir(home) / BUSY_FILE
    patterns = []
    text = _read_state(path, _busy_file_error) or ""
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            compile_busy(line)
        except ValueError as exc:
            raise QueueSetupError(
                f"{path}:{number}: {exc}; fix or remove that line (it is added to the "
                f"--busy of every run in lane {BUSY_LANE!r})"
            ) from None
        patterns.append(line)
    return patterns


def parse_json(data: str | bytes) -> object:
    """``json.loads``, with nesting too deep for the parser a ``ValueError`` like any other
    damage (a deeply nested state file must not end its readers in a ``RecursionError``)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def is_int(value: object, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool) within ``low``..``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: object, low: float, high: float) -> bool:
    """Whether ``value`` is a finite int or float (not a bool) within ``low``..``high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and low <= value <= high
    except OverflowError:  # an int too large for a float
        return False


def is_wall_time(value: object, now: float | None = None) -> bool:
    """Whether ``value`` can be a wall-clock time the queue wrote: from 0 to a day past now."""
    return is_number(value, 0.0, (time.time() if now is None else now) + CLOCK_SLACK)


def default_owner() -> str:
    """The user name, as ``--who`` defaults to it."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers): the uid still tells owners apart
        return f"uid{os.getuid()}"


def state_dir(home: str | os.PathLike[str] | None = None) -> Path:
    """``home``, else ``$STAGELOAD_HOME``, else ``~/.stageload``.

    ``QueueSetupError`` when ``$STAGELOAD_HOME`` is set but empty: most likely a variable
    that was meant to hold a path and did not (``STAGELOAD_HOME=$UNSET``), and falling back
    to ``~/.stageload`` would put the runs in another queue than the user meant.
    """
    if home is not None:
        return Path(home)
    env = os.environ.get(HOME_ENV)
    if env is None:
        return Path.home() / ".stageload"
    if not env.strip():
        raise QueueSetupError(
            f"{HOME_ENV} is set but empty ({env!r}); set it to a folder, e.g. "
            f"{HOME_ENV}=/tmp/stageload, or unset it to use ~/.stageload"
        )
    return Path(env)


def poll_interval(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between a waiting client's looks: ``$STAGELOAD_QUEUE_POLL`` or 0.5."""
    from ..units import parse_duration

    text = (os.environ if environ is None else environ).get(POLL_ENV, "")
    if not text:
        return POLL_DEFAULT
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise ValueError(f"{POLL_ENV}: {exc}") from None
    if seconds <= 0:
        raise ValueError(f"{POLL_ENV} must be above 0, got {text!r}; e.g. '0.5' or '100ms'")
    return seconds


# -- tickets ---------------------------------------------------------------------------


@dataclass
class Ticket:
    """One client's place in a lane, as stored in its ticket file.

    ``state``: ``waiting``; ``admitted`` once the queue let it go (the guard may still wait
    for its own admission); ``running`` once the command started (``pid`` is set).
    ``need`` is bytes, or None when unknown (the command runs alone).
    """

    seq: int
    owner: str
    command: list[str]
    need: int | None
    need_source: NeedSource
    client_pid: int
    enqueued: float  # wall-clock times (time.time()), comparable between processes
    state: Literal["waiting", "admitted", "running"] = "waiting"
    admitted: float | None = None
    started: float | None = None
    pid: int | None = None
    pid_created: float | None = None  # the command's create time, against pid reuse
    #: Set when read: the client died while its command runs on (unguarded) in its session.
    orphaned: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Ticket:
        """The ticket in ``data``; ``ValueError`` unless it is a ticket as ``to_bytes``
        writes it (a hand-edited or foreign file must not break the lane's readers)."""
        fields = parse_json(data)
        if not isinstance(fields, dict):
            raise ValueError(f"a ticket is a JSON object, got {type(fields).__name__}")
        try:
            ticket = cls(**fields)
        except TypeError as exc:
            raise ValueError(f"not a ticket: {exc}") from None
        ticket._check()
        return ticket

    def _check(self) -> None:
        now = time.time()

        def when(value: object) -> bool:
            return is_wall_time(value, now)

        problems = [
            name
            for name, ok in (
                ("seq", is_int(self.seq, 1, SEQ_MAX)),
                ("owner", isinstance(self.owner, str)),
                ("command", isinstance(self.command, list)
                 and all(isinstance(a, str) for a in self.command)),
                ("need", self.need is None or is_int(self.need, 0, SIZE_MAX)),
                ("need_source", self.need_source in ("declared", "learned", "unknown")),
                ("client_pid", is_int(self.client_pid, 1, PID_MAX)),
                ("enqueued", when(self.enqueued)),
                ("state", self.state in ("waiting", "admitted", "running")),
                ("admitted", self.admitted is None or when(self.admitted)),
                ("started", self.started is None or when(self.started)),
                ("pid", self.pid is None or is_int(self.pid, 1, PID_MAX)),
                ("pid_created", self.pid_created is None or when(self.pid_created)),
                ("orphaned", isinstance(self.orphaned, bool)),
            )
            if not ok
        ]  # fmt: skip
        if problems:
            raise ValueError(f"not a ticket: bad {', '.join(problems)}")


class HeldTicket:
    """This client's ticket: the open, locked file and its contents. Rewrite under the lane
    lock (``save``); ``remove`` at the end (the kernel releases the lock if we die first)."""

    def __init__(self, path: Path, fd: int, ticket: Ticket) -> None:
        self.path, self.fd, self.ticket = path, fd, ticket

    def save(self) -> None:
        data = self.ticket.to_bytes()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def remove(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)  # closing the last descriptor drops the flock
        self.fd = -1


# -- a lane ----------------------------------------------------------------------------


class Lane:
    """A lane's folder and the operations on it; methods marked *locked* need ``locked()``."""

    def __init__(self, home: str | os.PathLike[str] | None, name: str) -> None:
        self.home = state_dir(home)
        self.name = check_lane(name)
        self.dir = self.home / "lanes" / self.name
        self.tickets_dir = self.dir / "tickets"
        self.traces_dir = self.dir / "traces"
        self.history_path = self.dir / "history.jsonl"
        #: What the latest read of each kind of state skipped as damaged: ``tickets``
        #: (files that are not a ticket in range), ``owners`` (entries of owners.json),
        #: ``seq`` (1 when it was out of range), ``history`` (lines); set by each read.
        self.skipped: dict[str, int] = {}

    def create(self) -> Lane:
        """Make the lane's folders; ``QueueSetupError`` naming the folder if that fails."""
        for folder in (self.tickets_dir, self.traces_dir):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise QueueSetupError(_folder_error(self.home, folder, exc)) from None
        if not os.access(self.dir, os.W_OK) or not os.access(self.tickets_dir, os.W_OK):
            raise QueueSetupError(
                f"state folder {str(self.dir)!r} is not writable; set {HOME_ENV} to a folder "
                "you can write, e.g. STAGELOAD_HOME=/tmp/stageload"
            )
        return self

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the lane lock (milliseconds: read, decide, write; never while waiting)."""
        lock = self.dir / "lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if lock.is_dir():
                raise QueueSetupError(_file_error(lock, exc)) from None
            raise QueueSetupError(_folder_error(self.home, self.dir, exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def enqueue(self, owner: str, command: Sequence[str], need: int | None,
                need_source: NeedSource) -> HeldTicket:  # fmt: skip
        """*locked*: a new ticket at the end of the lane, locked by this process."""
        seq = self._next_seq()
        path = self.tickets_dir / f"{seq:012d}.json"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: cannot be taken
        # No new keys here: a client of an earlier version reads a ticket with an unknown
        # key as not a ticket and would not count it (lanes are shared between venvs).
        ticket = Ticket(seq, owner, list(command), need, need_source, os.getpid(), time.time())
        held = HeldTicket(path, fd, ticket)
        held.save()
        return held

    def tickets(self) -> list[Ticket]:
        """*locked*: the live tickets in ticket order; dead ones are removed on the way."""
        try:
            names = sorted(os.listdir(self.tickets_dir))
        except FileNotFoundError:
            return []
        except OSError as exc:  # a file in its place: say which, not a traceback
            raise QueueSetupError(_folder_error(self.home, self.tickets_dir, exc)) from None
        found = []
        skipped = 0
        for name in names:
            path = self.tickets_dir / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # its client just removed it
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    # Held: its client lives. It writes only under the lane lock we hold.
                    found.append(Ticket.from_bytes(os.pread(fd, 1 << 20, 0)))
                else:
                    # Nobody holds it: the client died (SIGKILL, crash) without removing it.
                    # Its command, if it still runs, keeps its place (and its need) until it
                    # ends; then, or if it never started, the ticket goes.
                    ticket = Ticket.from_bytes(os.pread(fd, 1 << 20, 0))
                    if ticket.state == "running" and _still_runs(ticket):
                        ticket.orphaned = True
                        found.append(ticket)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
            except (ValueError, OSError):
                skipped += 1  # not a ticket of ours in range (or a folder in its place): left
                continue
            finally:
                os.close(fd)
        self.skipped["tickets"] = skipped
        return found

    def owner_starts(self) -> dict[str, float]:
        """*locked*: owner -> wall time of their latest start in this lane.

        What cannot be read as that (torn or hand-edited: ``null``, a list, nested too
        deeply, a string or 1e300 as a time, an owner name no client could give) counts as
        no start, and is counted in ``skipped["owners"]``: the file only breaks ties in
        fairness, and the next start rewrites it whole. A folder in its place is a
        ``QueueSetupError`` naming it.
        """
        self.skipped["owners"] = 0
        try:
            data = parse_json(_read_state(self.dir / "owners.json") or "{}")
        except ValueError:
            data = None
        if not isinstance(data, dict):
            self.skipped["owners"] = 1
            return {}
        now = time.time()
        starts = {
            k: float(v)
            for k, v in data.items()
            if is_wall_time(v, now) and isinstance(k, str) and 0 < len(k) <= 64 and k.isprintable()
        }
        self.skipped["owners"] = len(data) - len(starts)
        return starts

    def record_start(self, owner: str, when: float) -> None:
        """*locked*: remember that ``owner`` started a command at ``when``."""
        starts = self.owner_starts()
        starts[owner] = when
        _write_atomic(self.dir / "owners.json", json.dumps(starts).encode())

    def _next_seq(self) -> int:
        """*locked*: the next ticket number: above the ``seq`` file and above every ticket
        in the lane, so a ``seq`` emptied or rolled back by hand neither reuses a live
        ticket's number nor puts the new ticket ahead of older ones."""
        path = self.dir / "seq"
        text = (_read_state(path) or "0").strip() or "0"
        # Emptied, garbled or out of range (400 digits): the tickets still tell.
        good = _TICKET_NUMBER.fullmatch(text) is not None
        last = int(text) if good else 0
        self.skipped["seq"] = 0 if good else 1
        try:
            names = os.listdir(self.tickets_dir)
        except FileNotFoundError:
            names = []
        except OSError as exc:
            raise QueueSetupError(_folder_error(self.home, self.tickets_dir, exc)) from None
        for name in names:
            match = _TICKET_NAME.fullmatch(name)
            if match:
                last = max(last, int(match[1]))
        if last >= SEQ_MAX:
            raise QueueSetupError(
                f"ticket numbers of lane {self.name!r} are used up (a ticket numbered "
                f"{last}); remove the lane's folder {str(self.dir)!r} while nothing runs in it"
            )
        seq = last + 1
        _write_atomic(path, str(seq).encode())
        return seq


def _still_runs(ticket: Ticket) -> bool:
    """Whether the command of a ticket whose client died still runs (same pid, same start)."""
    import psutil

    if ticket.pid is None or ticket.pid_created is None:
        return False
    try:
        proc = psutil.Process(ticket.pid)
        return proc.create_time() == ticket.pid_created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def list_lanes(home: str | os.PathLike[str] | None = None) -> list[str]:
    """Names of the lanes that exist under the state directory, sorted."""
    try:
        names = os.listdir(state_dir(home) / "lanes")
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if _LANE_RE.fullmatch(n))


def _read_state(path: Path, error: Callable[[Path, OSError], str] | None = None) -> str | None:
    """The text of a state file, None when there is none yet; ``QueueSetupError`` naming
    the file when it cannot be read (a folder in its place, no permission), its message
    from ``error`` (default ``_file_error``, for the queue's own files)."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise QueueSetupError((error or _file_error)(path, exc)) from None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise QueueSetupError(_file_error(path, exc)) from None


def _file_error(path: Path, exc: OSError) -> str:
    """Why a state file cannot be used, with the fix for that cause."""
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # removing the file would not help
        return (
            f"state file {str(path)!r} cannot be written ({why}); free space on its disk, "
            f"or set {HOME_ENV} to a folder on another one, e.g. STAGELOAD_HOME=/tmp/stageload"
        )
    what = "a folder" if path.is_dir() else "not usable"
    return (
        f"state file {str(path)!r} is {what} ({why}); remove it and the queue makes a new "
        "one (it holds no run's data)"
    )


def _busy_file_error(path: Path, exc: OSError) -> str:
    """Why ``busy.txt`` cannot be read: the user's own file, which the queue never makes."""
    fix = (
        "make it a file of --busy patterns, one a line, or remove the folder"
        if path.is_dir()
        else "make it readable, or remove it"
    )
    why = exc.strerror or exc
    return f"{str(path)!r}, your list of --busy patterns, cannot be read ({why}); {fix}"


def _folder_error(home: Path, folder: Path, exc: OSError) -> str:
    """Why ``folder`` cannot be used, naming a file in its way and the fix for it."""
    blocker = _file_in_the_way(folder)
    if blocker is not None:
        what = f"state folder {str(folder)!r} is a file, not a folder"
        if blocker != folder:
            what = (
                f"cannot use state folder {str(folder)!r}: {str(blocker)!r} is a file, not a folder"
            )
        if blocker != home and home in blocker.parents:
            # A file where a lane needs a folder (lanes/ram/tickets made by hand): another
            # STAGELOAD_HOME would not fix this one, moving the file does.
            return f"{what}; move it away or remove it, and the queue makes the folder again"
        return (
            f"{what}; move it away, or set {HOME_ENV} to a folder (now {str(home)!r}), e.g. "
            "STAGELOAD_HOME=/tmp/stageload"
        )
    return (
        f"cannot use state folder {str(folder)!r}: {exc.strerror or exc}; set {HOME_ENV} to a "
        f"writable folder (now {str(home)!r}), e.g. STAGELOAD_HOME=/tmp/stageload"
    )


def _file_in_the_way(folder: Path) -> Path | None:
    """The nearest of ``folder`` and its parents that exists and is not a folder, if any."""
    for path in (folder, *folder.parents):
        if path.is_dir():
            return None
        if os.path.lexists(path):
            return path
    return None
