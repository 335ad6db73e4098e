"""The per-stage report: table layout, JSON output and CLI errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.traces import MIB, eager_records, staged_records, write_real_trace, write_trace
from stageload.cli import main
from stageload.report.tables import format_report, report_dict, stage_order
from stageload.report.trace import load_summary


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    eager = write_trace(tmp_path / "eager.jsonl", eager_records())
    staged = write_trace(tmp_path / "staged.jsonl", staged_records())
    return eager, staged


def _row(text: str, first_cell: str) -> list[str]:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{text}")


def test_table_has_a_column_per_trace_and_dash_for_unreached_stages(pair) -> None:
    text = format_report([load_summary(p) for p in pair])
    assert _row(text, "stage") == ["stage", "eager", "staged"]
    assert _row(text, "encode") == ["encode", "700.0 MiB, 600 ms", "460.0 MiB, 700 ms"]
    assert _row(text, "denoise") == ["denoise", "720.0 MiB, 300 ms", "380.0 MiB, 800 ms"]
    assert _row(text, "decode") == ["decode", "-", "300.0 MiB, 900 ms"]
    assert _row(text, "swap growth") == ["swap growth", "0 B", "50.0 MiB"]
    assert _row(text, "lowest available") == [
        "lowest available",
        "280.0 MiB (28.0 %)",
        "500.0 MiB (50.0 %)",
    ]
    assert _row(text, "releases") == ["releases", "0", "2: 500.0 MiB in 200 ms"]
    assert _row(text, "duration")[1] == "1.5 s (no end record)"
    assert "'half way' at 1.6 s" in text


def test_stages_appear_in_first_seen_order_across_traces(tmp_path: Path) -> None:
    def trace(name: str, stages: list[str]) -> Path:
        records = [{"type": "start", "meta": {"label": name}}]
        for i, stage in enumerate(stages):
            records.append({"type": "event", "t": i + 1.0, "kind": "stage", "stage": stage})
            records.append({"type": "sample", "t": i + 1.5, "footprint": MIB})
        return write_trace(tmp_path / f"{name}.jsonl", records)

    summaries = [load_summary(trace("a", ["x", "z"])), load_summary(trace("b", ["x", "y", "z"]))]
    assert stage_order(summaries) == ["setup", "x", "z", "y"]
    assert _row(format_report(summaries), "y") == ["y", "-", "1.0 MiB, 1.0 s"]


def test_duplicate_labels_get_numbered_columns(tmp_path: Path) -> None:
    a = write_trace(tmp_path / "a.jsonl", staged_records())
    b = write_trace(tmp_path / "b.jsonl", staged_records())
    text = format_report([load_summary(a), load_summary(b)])
    assert _row(text, "stage") == ["stage", "staged #1", "staged #2"]


def test_a_pipe_in_a_label_or_stage_name_is_escaped_in_the_table(tmp_path: Path) -> None:
    """A bare '|' started another cell: the header had more cells than the table."""
    records = [
        {"type": "start", "meta": {"label": "bf16|eager"}},
        {"type": "event", "t": 1.0, "kind": "stage", "stage": "enc|dec"},
        {"type": "sample", "t": 1.5, "footprint": MIB},
    ]
    text = format_report([load_summary(write_trace(tmp_path / "t.jsonl", records))])
    table = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table]
    assert {len(row) for row in cells} == {2}, table
    assert cells[0] == ["stage", "bf16\\|eager"]
    assert ["enc\\|dec", "1.0 MiB, 500 ms"] in cells


def test_cli_prints_the_table(pair, capsys) -> None:
    assert main(["report", *map(str, pair)]) == 0
    out = capsys.readouterr().out
    assert _row(out, "decode") == ["decode", "-", "300.0 MiB, 900 ms"]


def test_cli_json(pair, capsys) -> None:
    assert main(["report", *map(str, pair), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["stages"] == ["setup", "encode", "denoise", "decode"]
    eager, staged = data["traces"]
    assert (eager["column"], staged["column"]) == ("eager", "staged")
    assert [s["stage"] for s in eager["stages"]] == ["setup", "encode", "denoise"]
    assert staged["swap"] == {"start": 0, "peak": 50 * MIB, "end": 20 * MIB, "growth": 50 * MIB}
    assert staged["releases"]["count"] == 2
    assert data == report_dict([load_summary(p) for p in pair])


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), ("", "is empty"), ("not json\nat all\n", "is not JSON")],
)
def test_cli_errors_are_one_line(tmp_path: Path, capsys, content: str | None, message: str) -> None:
    path = tmp_path / "x.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert err.startswith("stageload report: error: ")


def test_report_on_real_meter_traces(tmp_path: Path, capsys) -> None:
    plan = [("a", 64), ("b", 64), ("c", 64)]
    eager = write_real_trace(tmp_path / "eager.jsonl", "eager", plan, hold=True)
    staged = write_real_trace(tmp_path / "staged.jsonl", "staged", plan, hold=False)
    assert main(["report", str(eager), str(staged), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["stages"] == ["setup", "a", "b", "c"]
    e, s = ({st["stage"]: st for st in t["stages"]} for t in data["traces"])
    # Eager holds 192 MiB in stage c, staged 64 MiB. Each trace is compared with its own
    # stage a (64 MiB in both): the test process's own baseline drifts between two traces.
    grew_e = e["c"]["peak_footprint"] - e["a"]["peak_footprint"]
    grew_s = s["c"]["peak_footprint"] - s["a"]["peak_footprint"]
    assert grew_e - grew_s > 96 * MIB
    assert e["c"]["peak_footprint"] - e["a"]["peak_footprint"] > 100 * MIB
    assert data["traces"][1]["releases"]["count"] == 2
    assert all(st["samples"] > 0 for st in s.values() if st["stage"] != "setup")
    assert main(["report", str(eager), str(staged)]) == 0
    assert _row(capsys.readouterr().out, "c")[1:] != ["-", "-"]


SRC = str(Path(__file__).resolve().parents[2] / "src")


def _stageload(*args: str, home: Path, **kwargs) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    env = dict(os.environ, STAGELOAD_HOME=str(home))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "stageload", *args], env=env, stderr=subprocess.PIPE, **kwargs
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["report", "TRACE"], "the report"),
        (["report", "--json", "TRACE"], "the report"),
        (["queue"], "the queue's state"),
        (["queue", "--json"], "the queue's state"),
    ],
)
def test_output_that_cannot_be_written_is_one_line(
    pair, tmp_path: Path, args: list[str], what: str
) -> None:
    """`> /dev/full` printed a Python traceback (exit 1 by accident)."""
    args = [str(pair[0]) if a == "TRACE" else a for a in args]
    with open("/dev/full", "w") as full:
        proc = _stageload(*args, home=tmp_path / "state", stdout=full)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert (
        err.decode()
        == f"stageload {args[0]}: error: cannot write {what}: No space left on device\n"
    )


def test_a_reader_that_goes_away_is_no_error(tmp_path: Path) -> None:
    """`stageload report --json t.jsonl | head -1`: the rest of the output is not wanted."""
    records: list[dict] = [{"type": "start", "meta": {}}]
    for i in range(300):  # a column each: far more output than a pipe holds
        records += [
            {"type": "event", "t": i, "kind": "stage", "stage": "a", "pid": 1000 + i},
            {"type": "sample", "t": i + 0.5, "footprint": MIB},
        ]
    path = write_trace(tmp_path / "wide.jsonl", records)
    proc = _stageload("report", "--json", str(path), home=tmp_path, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"{\n"
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (0, b"")


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_a_label_or_stage_with_a_newline_or_an_escape_is_printed_escaped(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fixed: bool,
) -> None:
    """A `--label` or a stage name with a newline or an ESC was printed raw: it broke the
    table and could drive the reader's terminal. Now shown as \\n, \\x1b; plain text and
    the JSON keep it as it is. Control: the report without the escaping."""
    import stageload.report.tables as tables

    if not fixed:
        monkeypatch.setattr(tables, "printable", lambda text: text)
    label = "two\nlines\x1b[2J"
    metered = tmp_path / "metered.jsonl"
    assert main(["meter", "-o", str(metered), "--label", label, "--", "true"]) == 0
    records = staged_records("café 日本")
    for record in records:
        if record.get("stage") == "decode":
            record["stage"] = "de\x1b[31mcode\n"
    written = write_trace(tmp_path / "staged.jsonl", records)
    capsys.readouterr()
    assert main(["report", str(metered), str(written)]) == 0
    out = capsys.readouterr().out
    first_table = out.split("\n\n")[1]
    clean = "\x1b" not in out and all(line.startswith("|") for line in first_table.splitlines())
    assert clean is fixed, out
    if fixed:
        assert _row(out, "stage") == ["stage", "two\\nlines\\x1b[2J", "café 日本"]
        assert len(_row(out, "de\\x1b[31mcode\\n")) == 3  # one row of its own
    assert main(["report", "--json", str(metered)]) == 0
    assert json.loads(capsys.readouterr().out)["traces"][0]["column"] == label
