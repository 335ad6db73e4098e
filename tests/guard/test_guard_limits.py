"""Absurd values (a 401-digit number, a regex repeat no engine holds, more threads than a C
int) are usage errors naming the flag, for the guard, the queue and the demo: exit 2, one
line, no traceback. Before, each was an OverflowError, some only after the command started.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from stageload.cli import main
from stageload.guard import GuardConfig
from stageload.units import parse_duration, parse_size

PY = sys.executable
HUGE = "9" * 401
SIZE_MAX = (1 << 63) - 1  # units.SIZE_MAX: 8 EiB - 1
DURATION_MAX = 100 * 365.25 * 86400  # units.DURATION_MAX: 100 years


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``main(argv)``; assert it is a usage error (exit 2, argparse's or the command's
    own) without a traceback; return stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "OverflowError" not in err, err
    return err


@pytest.mark.parametrize(
    ("command", "flag", "value", "message"),
    [
        ("guard", "--swap-budget", HUGE, "is too large"),
        ("guard", "--swap-limit", HUGE, "is too large"),
        ("guard", "--swap-budget", "9000P", "is too large"),
        ("guard", "--kill-free", HUGE + "G", "is too large"),
        ("guard", "--wait-free", HUGE + "M", "is too large"),
        ("guard", "--kill-free", HUGE, "invalid percentage"),
        ("guard", "--quiet-for", HUGE, "is too long"),
        ("guard", "--grace", HUGE, "is too long"),
        ("guard", "--start-timeout", HUGE + "h", "is too long"),
        ("guard", "--poll", "99999999999", "is too long"),
        ("guard", "--busy", "a{99999999999}", "invalid --busy pattern"),
        ("run", "--memory", HUGE, "is too large"),
        ("run", "--swap-budget", HUGE, "is too large"),
        ("run", "--quiet-for", HUGE, "is too long"),
    ],
)
def test_huge_values_are_usage_errors_naming_the_flag(
    command: str,
    flag: str,
    value: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("STAGELOAD_HOME", str(tmp_path))
    ran = f"{tmp_path}/ran"
    err = _usage_error(
        [command, "--wait-free", "0", flag, value, "--", PY, "-c", f"open({ran!r}, 'w')"],
        capsys,
    )
    line = next(line for line in err.splitlines() if "error:" in line)
    assert f"argument {flag}" in line or flag in line, line
    assert message in line, line
    assert len(line) < 300, "the 401 digits are cut short in the message"
    assert not os.path.exists(ran)


def test_demo_threads_beyond_a_c_int_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(["demo", "--threads", "99999999999999999999", "-o", str(tmp_path)], capsys)
    assert "--threads must be at most 4096" in err


def test_the_library_rejects_the_same_values() -> None:
    """GuardConfig and the units parsers: ValueError naming the value, never OverflowError."""
    for bad in (HUGE, 10**400, SIZE_MAX + 1):
        with pytest.raises(ValueError, match="too large"):
            parse_size(bad)
    assert parse_size(SIZE_MAX) == SIZE_MAX
    for bad_duration in (HUGE, "99999999999", float("inf"), float("nan"), DURATION_MAX * 2):
        with pytest.raises(ValueError, match="too long"):
            parse_duration(bad_duration)
    assert parse_duration("876000h") == 876000 * 3600.0  # 100 x 365 days: still allowed
    with pytest.raises(ValueError, match="too large"):
        GuardConfig([PY], swap_budget=HUGE)
    with pytest.raises(ValueError, match="too long"):
        GuardConfig([PY], poll=1e300)
    with pytest.raises(ValueError, match="invalid --busy pattern"):
        GuardConfig([PY], busy=["a{99999999999}"])
