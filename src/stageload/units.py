"""Parse and format byte sizes and durations, shared by the library and the CLI flags."""

from __future__ import annotations

import re

# The unit is a prefix with an optional "i" and an optional "B" (G, GB, Gi, GiB), or "B"
# alone. An "i" needs a prefix: "2ib" was once read as 2 bytes.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])i?)?b?\s*$", re.IGNORECASE)
# A number followed by anything, to say which part is not a unit.
_NUMBER_THEN_RE = re.compile(r"^\s*\d+(?:\.\d+)?\s*(\S.*?)\s*$")
_SIZE_UNITS = "units are B, K, M, G, T and P, also written KB or KiB, all binary (1K = 1024 B)"
_SIZE_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$", re.IGNORECASE)
_DURATION_SCALE = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}

#: The largest size accepted: 8 EiB - 1, what a signed 64-bit byte count holds. Beyond it a
#: number is a typo, and turning it into an int (or a C value) fails far from the flag.
SIZE_MAX = (1 << 63) - 1
#: The longest duration accepted: 100 years. Beyond that no timeout or interval means
#: anything, and the OS's timers (select, sleep: 2**63 ns, 292 years) overflow.
DURATION_MAX = 100 * 365.25 * 86400


def _shown(text: object) -> str:
    """``repr(text)``, cut short for the 401-digit number a typo or a fuzzer gives."""
    shown = repr(text)
    if len(shown) <= 40:
        return shown
    return f"{shown[:18]}...{shown[-8:]} ({len(str(text))} characters)"


def parse_size(text: str | int) -> int:
    """Parse a size such as ``"12G"``, ``"512MiB"``, ``"1.5g"`` or ``"4096"`` into bytes.

    Suffixes are binary (``G``, ``GB``, ``Gb`` and ``GiB`` all mean GiB), as in ``free -h``
    and ``sysctl vm.swapusage``; anything else after the number is refused.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {_shown(text)}")
        if text > SIZE_MAX:
            raise ValueError(_too_large_size(text))
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(_invalid_size(text))
    number, unit = match.groups()
    value = float(number) * (1 << _SIZE_SHIFT[(unit or "").lower()])  # inf for 400 digits
    if not value <= SIZE_MAX:
        raise ValueError(_too_large_size(text))
    if unit is None and not value.is_integer():
        # "--budget 1.5" meant 1.5 GiB, not the 1 byte it was cut to: a fraction needs a unit.
        raise ValueError(
            f"invalid size {_shown(text)}: a number of bytes is whole; give a unit for a "
            f"fraction, e.g. '{number}G' or '{number}M'"
        )
    return int(value)


def _invalid_size(text: object) -> str:
    unit = _NUMBER_THEN_RE.match(str(text))
    if unit:
        return (
            f"invalid size {_shown(text)}: {_shown(unit.group(1))} is not a unit; "
            f"{_SIZE_UNITS}, e.g. '8G', '512M' or '1.5GiB'"
        )
    return (
        f"invalid size {_shown(text)}: use a number with an optional unit; {_SIZE_UNITS}, "
        "e.g. '8G', '512M' or '1.5GiB'"
    )


def _too_large_size(text: object) -> str:
    return f"size {_shown(text)} is too large: give less than 8 EiB (8192P), e.g. '8G' or '512M'"


def parse_percent_or_size(text: str) -> tuple[str, float]:
    """Parse ``"40%"``/``"40"`` as a percentage or ``"12G"`` as bytes.

    Returns ``("percent", value)`` or ``("bytes", value)``. A bare number is a percentage,
    because that is how ``--wait-free 40`` reads in the docs.
    """
    s = str(text).strip()
    if s.endswith("%") or re.fullmatch(r"\d+(\.\d+)?", s):
        try:
            value = float(s.rstrip("%"))
        except ValueError:
            value = -1.0  # "x%": not a number, reported as not a percentage
        if not 0 <= value <= 100:
            raise ValueError(f"invalid percentage {_shown(text)}: must be between 0 and 100")
        return "percent", value
    if not _SIZE_RE.match(s):
        raise ValueError(
            f"invalid amount {_shown(text)}: use a percentage like '40%' or a size like '12G'"
        )
    return "bytes", float(parse_size(s))  # a size too large says so


def parse_duration(text: str | float) -> float:
    """Parse a duration such as ``"1m"``, ``"30s"``, ``"500ms"`` or ``"2.5"`` (seconds)."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"duration must not be negative, got {_shown(text)}")
        if not text <= DURATION_MAX:  # also NaN
            raise ValueError(_too_long(text))
        return float(text)
    if str(text).strip().startswith("-"):
        raise ValueError(f"duration must not be negative, got {_shown(text)}: e.g. '30s' or '1m'")
    match = _DURATION_RE.match(str(text))
    if not match:
        raise ValueError(f"invalid duration {_shown(text)}: use e.g. '30s', '1m', '500ms' or '2.5'")
    number, unit = match.groups()
    seconds = float(number) * _DURATION_SCALE[(unit or "").lower()]
    if not seconds <= DURATION_MAX:
        raise ValueError(_too_long(text))
    return seconds


def _too_long(text: object) -> str:
    return f"duration {_shown(text)} is too long: at most 100 years, e.g. '30s', '1m' or '2h'"


def format_size(n: int | float | None, *, precision: int = 1) -> str:
    """Format bytes in binary units, e.g. ``1.5 GiB``; ``None`` gives ``"-"``."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_apart(a: int, b: int) -> tuple[str, str]:
    """``a`` and ``b`` as :func:`format_size` gives them, with more digits where that makes
    two different sizes read the same ("2.0 MiB alone is over the budget of 2.0 MiB"),
    and in bytes where three digits do not part them."""
    for precision in (1, 3):
        shown = format_size(a, precision=precision), format_size(b, precision=precision)
        if a == b or shown[0] != shown[1]:
            return shown
    return f"{a} B", f"{b} B"


def format_duration(seconds: float | None) -> str:
    """Format seconds as ``"850 ms"``, ``"12.3 s"`` or ``"4 min 05 s"``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s"
