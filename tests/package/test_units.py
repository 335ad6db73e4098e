"""Sizes and durations parse the same way for the library and every CLI flag."""

from __future__ import annotations

import pytest

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
