"""Sizes and durations parse the same way for the library and every CLI flag."""

from __future__ import annotations

import re

import pytest

from stageload import units
from stageload.cli import main
from stageload.units import (
    format_duration,
    format_size,
    parse_duration,
    parse_percent_or_size,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8G", 8 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096), ("2kb", 2048)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "G", "-1G", "8X", "eight"])
def test_parse_size_rejects_with_an_example(bad):
    with pytest.raises(ValueError, match="e.g. '8G'"):
        parse_size(bad)


# The size pattern before the fix: "i" and "B" were one optional suffix, with or without a
# prefix, so "2ib" was 2 bytes.
_OLD_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)i?b?\s*$", re.IGNORECASE)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
@pytest.mark.parametrize(("bad", "unit"), [("2ib", "'ib'"), ("2i", "'i'"), ("2 iB", "'iB'")])
def test_an_i_without_a_prefix_is_not_a_unit(monkeypatch, capsys, fixed, bad, unit):
    """'2ib' was read as 2 bytes. Now it is refused with the value, the part that is not a
    unit and examples, by the library and by a flag (exit 2). Control: the old pattern."""
    if not fixed:
        monkeypatch.setattr(units, "_SIZE_RE", _OLD_SIZE_RE)
    try:
        parse_size(bad)
    except ValueError as exc:
        said = str(exc)
    else:
        said = ""
    refused = f"invalid size {bad!r}: {unit} is not a unit" in said and "e.g. '8G'" in said
    assert refused is fixed, said
    try:
        # Nothing to wait for in the control, where the flag is taken and `true` runs.
        code = main(["guard", "--wait-free", "0%", "--swap-budget", bad, "--", "true"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert (code == 2 and f"{unit} is not a unit" in err) is fixed, (code, err)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2 GiB", 2 << 30), ("2GB", 2 << 30), ("2Gb", 2 << 30), ("2Ki", 2048), ("2b", 2), ("2 B", 2)],
)
def test_documented_units_still_parse(text, expected):
    """What the docs and the docstring promise stays: binary units, B/iB optional, a space
    allowed (format_size writes '1.5 GiB')."""
    assert parse_size(text) == expected


def test_percent_or_size():
    assert parse_percent_or_size("40%") == ("percent", 40.0)
    assert parse_percent_or_size("40") == ("percent", 40.0)
    assert parse_percent_or_size("12G") == ("bytes", float(12 << 30))
    with pytest.raises(ValueError, match="between 0 and 100"):
        parse_percent_or_size("140%")
    with pytest.raises(ValueError, match="'40%' or a size like '12G'"):
        parse_percent_or_size("lots")


def test_durations():
    assert parse_duration("1m") == 60
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2.5") == 2.5
    with pytest.raises(ValueError, match="'30s'"):
        parse_duration("soon")
    with pytest.raises(ValueError, match="must not be negative, got '-1s'"):
        parse_duration("-1s")


def test_formatting():
    assert format_size(None) == "-"
    assert format_size(512) == "512 B"
    assert format_size(3 << 29) == "1.5 GiB"
    assert format_size(-(1 << 20)) == "-1.0 MiB"
    assert format_duration(0.25) == "250 ms"
    assert format_duration(12.34) == "12.3 s"
    assert format_duration(245) == "4 min 05 s"


@pytest.mark.parametrize("bad", ["1.5", "0.5", "12.7b"])
def test_a_fraction_of_a_byte_is_refused_not_cut(capsys, tmp_path, bad):
    """'--budget 1.5' ran with a budget of 1 byte (meant: 1.5 GiB), and '0.5' said 'it must
    be more than 0 bytes'. A fraction needs a unit; a unit's fraction stays ('1.5G')."""
    with pytest.raises(ValueError, match=r"a number of bytes is whole; .* e\.g\. '"):
        parse_size(bad)
    assert parse_size("1.5K") == 1536
    script = tmp_path / "script.py"
    script.write_text("pass\n")
    try:
        code = main(["auto", "--budget", bad, "--", "python", str(script)])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "whole" in err and bad in err, (code, err)


@pytest.mark.parametrize(
    ("a", "b", "shown"),
    [
        (2_101_248, 2 << 20, ("2.004 MiB", "2.000 MiB")),  # a helper's "2.0 MiB ... of 2.0 MiB"
        ((2 << 20) + 1, 2 << 20, ("2097153 B", "2097152 B")),  # three digits do not part them
        (3 << 30, 2 << 20, ("3.0 GiB", "2.0 MiB")),  # apart already: as format_size gives
        (2 << 20, 2 << 20, ("2.0 MiB", "2.0 MiB")),
    ],
)
def test_format_apart_never_shows_two_sizes_as_one(a, b, shown):
    assert units.format_apart(a, b) == shown
