"""The README's first Python example runs, and prints what the README says it prints."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def blocks(lang: str) -> list[str]:
    """The fenced code blocks whose info string is ``lang`` ("" for plain fences)."""
    found, current, info = [], None, ""
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current, info = [], line[3:].strip()
            else:
                if info == lang:
                    found.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return found


def test_readme_example_runs_and_prints_what_the_readme_shows():
    example = blocks("python")[0]
    shown = next(b for b in blocks("") if b.startswith("model 'encoder' was released"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, str(README), "exec"), {"__name__": "readme"})
    assert out.getvalue().strip() == shown.strip()


def test_readme_meter_example_writes_a_trace_with_the_events(tmp_path, monkeypatch):
    from stageload.report.trace import read_trace

    first = blocks("python")[0]
    meter = next(b for b in blocks("python") if "MemoryMeter(" in b)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(first, str(README), "exec"), namespace)
        exec(compile(meter, str(README), "exec"), namespace)
    trace = read_trace(tmp_path / "staged.jsonl")
    kinds = [e.kind for e in trace.events]
    assert kinds == ["stage", "load", "stage", "release", "load"]


def test_readme_starts_with_the_demo_and_the_test_command():
    first = blocks("bash")[0]
    assert "stageload demo" in first
    assert "pytest" in first
    ci = (README.parent / ".ci" / "run").read_text()
    assert (
        "ruff check . && python -m pytest -q" in ci
        and "ruff check . && python -m pytest -q" in first
    )
