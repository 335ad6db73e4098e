"""What the guard is told and what it answers: thresholds, the run's configuration, its result.

``Amount`` parses the memory floors, ``GuardConfig`` converts every field at construction
(see ``stageload.units``), and ``GuardResult`` is how a guarded run ended.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import StageloadError
from ..memory import SystemMemory
from ..units import format_duration, format_size, parse_percent_or_size, parse_size

# -- thresholds ------------------------------------------------------------------------


@dataclass(frozen=True)
class Amount:
    """A memory floor: a percentage of total memory or an absolute number of bytes."""

    kind: Literal["percent", "bytes"]
    value: float

    @classmethod
    def parse(cls, text: str | Amount) -> Amount:
        """``"40%"``/``"40"`` -> percent, ``"12G"`` -> bytes (``units.parse_percent_or_size``)."""
        if isinstance(text, Amount):
            return text
        kind, value = parse_percent_or_size(text)
        return cls("percent" if kind == "percent" else "bytes", value)

    def floor(self, total: int | None) -> int | None:
        """The floor in bytes for a machine with ``total`` bytes (None if total is unknown)."""
        if self.kind == "bytes":
            return int(self.value)
        return None if total is None else int(total * self.value / 100)

    def shortfall(self, reading: SystemMemory) -> str | None:
        """``"available 31% < 40%"`` when the reading is under this floor, else None.

        None also when available memory could not be read; callers report that separately.
        """
        if self.kind == "percent":
            pct = reading.available_percent
            if pct is None or pct >= self.value:
                return None
            return f"available {pct:.0f}% < {self}"
        if reading.available is None or reading.available >= self.value:
            return None
        return f"available {format_size(reading.available, precision=2)} < {self}"

    def __str__(self) -> str:
        if self.kind == "percent":
            return f"{self.value:g}%"
        return format_size(self.value, precision=2)


# -- configuration and result ----------------------------------------------------------


@dataclass(init=False)
class GuardConfig:
    """What to run and the rules to admit, watch and stop it. Defaults match the CLI.

    The constructor takes what a user writes: sizes as ``units`` strings (``"8G"``) or
    bytes, floors as a percentage or a size (or an ``Amount``), durations as seconds or
    ``units`` strings (``"1m"``); ``poll=None`` polls adaptively. It converts each at once,
    so the fields hold only their final types, and raises ``ValueError`` naming the flag
    for a bad value. ``dataclasses.replace`` works (it passes the converted values back in).
    """

    command: list[str]
    wait_free: Amount
    swap_limit: int | None
    swap_budget: int
    busy: tuple[str | re.Pattern[str], ...]
    quiet_for: float
    start_timeout: float | None
    kill_free: Amount
    poll: float | None
    grace: float
    trace: str | os.PathLike[str] | None
    #: Whether the command's own StagedModels events go into ``trace`` (STAGELOAD_TRACE);
    #: False sets STAGELOAD_EVENTS=0 for the command (docs/trace-format.md).
    events: bool
    #: Keep processes of the command's group running after the command exits by itself
    #: (by default they are stopped: SIGTERM, then SIGKILL after ``grace``).
    leave_group: bool
    #: ``busy`` compiled.
    busy_patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False)

    def __init__(
        self,
        command: Sequence[str],
        wait_free: Amount | str = "40%",
        swap_limit: int | str | None = None,
        swap_budget: int | str = "8G",
        busy: Sequence[str | re.Pattern[str]] = (),
        quiet_for: float | str = 60.0,
        start_timeout: float | str | None = None,
        kill_free: Amount | str = "10%",
        poll: float | str | None = None,
        grace: float | str = 5.0,
        trace: str | os.PathLike[str] | None = None,
        events: bool = True,
        leave_group: bool = False,
    ) -> None:
        from ..units import parse_duration

        self.command = list(_not_a_string("command", command))
        if not self.command:
            raise ValueError("no command given: put it after '--', e.g. -- python run.py")
        self.wait_free = Amount.parse(wait_free)
        self.kill_free = Amount.parse(kill_free)
        self.swap_limit = None if swap_limit is None else parse_size(swap_limit)
        self.swap_budget = parse_size(swap_budget)
        if self.swap_limit is not None and self.swap_limit <= self.swap_budget:
            # Admission needs swap used + budget < limit, and swap used is never below 0.
            raise ValueError(
                f"--swap-limit {format_size(self.swap_limit)} is not above --swap-budget "
                f"{format_size(self.swap_budget)}, so the command could never start; raise "
                "--swap-limit or lower --swap-budget (e.g. --swap-limit 16G --swap-budget 4G)"
            )
        self.quiet_for = parse_duration(quiet_for)
        self.grace = parse_duration(grace)
        self.start_timeout = None if start_timeout is None else parse_duration(start_timeout)
        self.poll = None if poll is None else parse_duration(poll)
        if self.poll is not None and self.poll <= 0:
            raise ValueError(f"poll interval must be above 0, got {self.poll!r}: e.g. '0.5s'")
        self.busy = tuple(_not_a_string("busy", busy))
        self.busy_patterns = tuple(compile_busy(p) for p in self.busy)
        self.trace = trace
        self.events = events
        self.leave_group = leave_group


def _not_a_string(name: str, value: Any) -> Any:
    """``value`` as given, or ``TypeError`` for a plain string where a sequence of strings
    belongs: iterating ``"ffmpeg"`` gives ``"f"``, ``"m"``, ... (a --busy ``"f"`` matches
    nearly every process; a command ``"true"`` runs ``t``)."""
    if not isinstance(value, (str, bytes)):
        return value
    example: list[Any] = [value]
    if name == "command" and isinstance(value, str):
        with contextlib.suppress(ValueError):  # unbalanced quotes: the one-item example
            example = shlex.split(value)  # "python run.py" -> ['python', 'run.py']
    raise TypeError(
        f"{name} must be a list of strings, got the plain string {value!r} (which would be "
        f"read letter by letter); give a list: {name}={example!r}"
    )


def compile_busy(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    """Compile a --busy pattern, with a message that names it when it is not a regex."""
    if (pattern.pattern if isinstance(pattern, re.Pattern) else pattern) == "":
        # re.search("", line) is true for every line: the command would wait for ever.
        raise ValueError(
            "an empty --busy pattern matches every process, so the command would never "
            "start; give a part of the other program's command line, e.g. --busy ffmpeg"
        )
    if isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        # OverflowError: a repeat count over what re can hold ('a{99999999999}')
        raise ValueError(
            f"invalid --busy pattern {pattern!r}: {exc}; it is a Python regular expression "
            r"searched in full command lines, e.g. 'ffmpeg' or 'python .*train\.py'"
        ) from None


def floors_warning(config: GuardConfig, reading: SystemMemory) -> str | None:
    """A warning when the stop floor is not under the start floor: the command would be
    stopped as soon as it starts, unless memory frees up after admission."""
    wait = config.wait_free.floor(reading.total)
    kill = config.kill_free.floor(reading.total)
    if wait and kill is not None and kill >= wait:
        return (
            f"stageload guard: warning: --kill-free {config.kill_free} is not under "
            f"--wait-free {config.wait_free}; the command may be stopped as soon as it starts"
        )
    return None


class GuardSetupError(StageloadError):
    """The guard could not set up (e.g. the trace file cannot be written); nothing ran."""


Outcome = Literal["exited", "stopped", "signalled", "no_room", "cannot_start"]


@dataclass
class GuardResult:
    """How a guarded run ended. ``exit_code`` is what ``stageload guard`` exits with."""

    exit_code: int
    outcome: Outcome
    reason: str
    waited: float
    ran: float | None = None
    peak_footprint: int | None = None
    swap_growth: int | None = None
    pid: int | None = None
    #: Processes of the command's group still running when the command exited by itself.
    leftovers: int = 0
    #: True when they were left running (``leave_group``), False when the guard stopped them.
    left_running: bool = False
    #: Processes that had left the command's group (``setsid``) and were found when it
    #: ended or was stopped: stopped with it (or left running, as ``left_running`` says).
    escaped: int = 0

    def summary(self) -> str:
        """The final stderr line: waited, ran, peak footprint, swap growth, why it ended,
        and the processes the command left running in its group."""
        ran = "did not run" if self.ran is None else f"ran {format_duration(self.ran)}"
        growth = "-" if self.swap_growth is None else _signed_size(self.swap_growth)
        rest = ""
        what = "left running (--leave-group)" if self.left_running else "stopped"
        if self.leftovers:
            rest = f"; {self.leftovers} processes it left in its group {what}"
        if self.escaped:
            rest += f"; {self.escaped} processes that had left its group (setsid) {what}"
        return (
            f"stageload guard: waited {format_duration(self.waited)}, {ran}, "
            f"peak footprint {format_size(self.peak_footprint)}, swap {growth}; "
            f"{self.reason}{rest} (exit {self.exit_code})"
        )


def _signed_size(n: int) -> str:
    return ("+" if n >= 0 else "") + format_size(n)
