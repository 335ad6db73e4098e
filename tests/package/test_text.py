"""Text from users and files is shown escaped, and each shown text has one original."""

from __future__ import annotations

from pathlib import Path

import pytest

from stageload.cli import main
from stageload.text import printable

# Pairs that must not print alike: a backslash typed before a letter, and the control
# character that letter stands for in an escape.
SAMPLES = [
    "run\\nA",
    "run\nA",
    "\\x1b[2J",
    "\x1b[2J",
    "C:\\data\\new",
    "ends with \\",
    "\\\\",
    "\\",
    "café 日本 \u202e",
    "plain",
    "",
]


def _unescaped(shown: str) -> str:
    """``shown`` read back as a Python string literal's body would be: the decoder is
    Python's own, not ``printable``'s inverse."""
    return shown.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _old_printable(text: str) -> str:
    # printable before the fix: a backslash left as it was.
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_each_shown_text_reads_back_as_its_original(fixed: bool) -> None:
    """A literal backslash-n and a newline printed the same (``run\\nA`` for both); now a
    backslash is doubled, so Python's own unicode_escape reads every output back to its
    text, and no two texts print alike. Control: the backslash left as it was."""
    show = printable if fixed else _old_printable
    shown = [show(text) for text in SAMPLES]
    one_to_one = all(_unescaped(s) == t for s, t in zip(shown, SAMPLES, strict=True)) and len(
        set(shown)
    ) == len(SAMPLES)
    assert one_to_one is fixed, shown
    assert all(s.isprintable() for s in shown)
    assert show("plain") == "plain" and show("café 日本") == "café 日本"


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_a_label_typed_with_a_backslash_and_one_with_a_newline_are_told_apart(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fixed: bool,
) -> None:
    """``stageload meter --label 'run\\nA'`` (typed: a backslash, then n) and ``--label
    $'run\\nA'`` (a newline) gave two report columns both headed ``run\\nA``. Now the first
    is ``run\\\\nA``. Control: the report with the old printable."""
    import stageload.report.tables as tables

    if not fixed:
        monkeypatch.setattr(tables, "printable", _old_printable)
    typed, newline = tmp_path / "typed.jsonl", tmp_path / "newline.jsonl"
    assert main(["meter", "-o", str(typed), "--label", "run\\nA", "--", "true"]) == 0
    assert main(["meter", "-o", str(newline), "--label", "run\nA", "--", "true"]) == 0
    capsys.readouterr()
    assert main(["report", str(typed), str(newline)]) == 0
    header = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| stage")
    )
    columns = [cell.strip() for cell in header.strip("|").split("|")][1:]
    assert (columns == ["run\\\\nA", "run\\nA"]) is fixed, columns
    assert (columns[0] == columns[1]) is not fixed, columns
