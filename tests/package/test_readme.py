"""The README's examples run and print what the README says; its commands parse with the real
CLI; every page it links to exists; bench/results keeps what the docs cite, and no logs.

The README is the front door (issue 37): the pages beside it (bench/README.md,
CONTRIBUTING.md, tests/README.md, docs/staged.md) are checked for links and commands too.
Each checker has a control: the same checker on a broken copy must complain.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
#: The pages of the front door: their links and commands are checked here.
PAGES = [
    README,
    ROOT / "bench" / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "tests" / "README.md",
    ROOT / "docs" / "staged.md",
]
#: Issue 37: the README stays a front door a newcomer reads in five minutes.
README_MAX_BYTES = 15 * 1024


def blocks(lang: str, text: str | None = None) -> list[str]:
    """The fenced code blocks whose info string is ``lang`` ("" for plain fences)."""
    found, current, info = [], None, ""
    for line in (README.read_text() if text is None else text).splitlines():
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


def run_example(code: str, namespace: dict | None = None) -> str:
    """Run a README block as a script would, and return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(
            compile(code, str(README), "exec"),
            {"__name__": "readme"} if namespace is None else namespace,
        )
    return out.getvalue()


# -- the first example -------------------------------------------------------------------


def test_readme_example_runs_and_prints_what_the_readme_shows():
    example = blocks("python")[0]
    shown = next(b for b in blocks("") if b.startswith("model 'encoder' was released"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert run_example(example).strip() == shown.strip()
    assert not said, [str(w.message) for w in said]  # a newcomer's first run warns of nothing


def test_control_the_example_with_gradients_on_warns_of_the_graph_it_cuts():
    example = blocks("python")[0]
    broken = example.replace("with models, torch.no_grad():", "with models:", 1)
    assert broken != example
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run_example(broken)
    assert any("an autograd graph held" in str(w.message) for w in said)


def test_control_the_example_check_fails_when_the_code_no_longer_does_what_is_shown():
    # Without the stage change the encoder is never released: the printed events differ.
    example = blocks("python")[0]
    broken = example.replace('    models.enter("decode")', "    pass", 1)
    assert broken != example
    shown = next(b for b in blocks("") if b.startswith("model 'encoder' was released"))
    assert run_example(broken).strip() != shown.strip()


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_readme_meter_example_writes_a_trace_with_the_events(tmp_path, monkeypatch, fixed):
    """The example runs clean as copied: it ran the models with gradients on, so releasing
    the encoder warned of the autograd graph that held it. Control: without no_grad."""
    from stageload.report.trace import read_trace

    first = blocks("python")[0]
    meter = next(b for b in blocks("python") if "MemoryMeter(" in b)
    if not fixed:
        broken = meter.replace("with torch.no_grad():", "if True:", 1)
        assert broken != meter
        meter = broken
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    run_example(first, namespace)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run_example(meter, namespace)
    trace = read_trace(tmp_path / "staged.jsonl")
    kinds = [e.kind for e in trace.events]
    assert kinds == ["stage", "load", "stage", "release", "load"]
    assert (not said) is fixed, [str(w.message) for w in said]
    assert fixed or any("an autograd graph held" in str(w.message) for w in said)


# -- the diffusers example ---------------------------------------------------------------

#: The call's size in the tests: 2 steps instead of 20, and a 128 x 128 image instead of
#: the pipeline's default 1024 x 1024 (whose decode alone took 25 s a call in bfloat16 on
#: one thread, three quarters of this module's time). The models and stages are the same.
SMALL_CALL = "num_inference_steps=2, height=128, width=128"

#: What this machine lacks, swapped for what it has: no hub download (a tiny Qwen-Image 2.1
#: with random weights, built locally), no MPS (the CPU), and a small call (``SMALL_CALL``)
#: so the test takes seconds. Each must occur exactly once, so a changed README fails here
#: loudly.
SWAPS = {
    '"Qwen/Qwen-Image-2.1"': None,
    'device="mps"': 'device="cpu"',
    "num_inference_steps=20": SMALL_CALL,
}


#: The local fixture saves a processor class of stageload's (transformers' own needs
#: torchvision); diffusers loads it back only while its module is imported. A real
#: checkpoint needs no such line.
FIXTURE = "import stageload.testing.diffusers  # the fixture's processor class\n"


def diffusers_example() -> str:
    return next(b for b in blocks("python") if "staged_pipeline(" in b)


def eager_script(example: str, path: Path) -> str:
    """The same call on the pipeline loaded eagerly with ``from_pretrained``, saved to
    ``argv[1]``; and, for the control, with the next seed, saved to ``argv[2]``."""
    prompt = re.search(r'pipe\(("[^"]*")', example).group(1)
    seed = int(re.search(r"manual_seed\((\d+)\)", example).group(1))
    return FIXTURE + (
        "import sys, torch\n"
        "from diffusers import QwenImage21Pipeline\n"
        f"pipe = QwenImage21Pipeline.from_pretrained({str(path)!r}, torch_dtype=torch.bfloat16)\n"
        f"for seed, out in (({seed}, sys.argv[1]), ({seed + 1}, sys.argv[2])):\n"
        f"    image = pipe({prompt}, {SMALL_CALL},\n"
        "                 generator=torch.Generator().manual_seed(seed)).images[0]\n"
        "    image.save(out)\n"
    )


def pixels(path: Path) -> bytes:
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


@pytest.fixture(scope="module")
def diffusers_runs(tmp_path_factory):
    """The README's diffusers example run as a script under ``stageload meter``, as the README
    says to run one, and the same call loaded eagerly, each in its own process.

    Reference: eager, ``eager_script`` (``from_pretrained`` with no stageload). torch on one
    thread in both processes (``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``), so the same
    summation order on any machine."""
    pytest.importorskip("diffusers")
    from stageload.testing.diffusers import build

    tmp = tmp_path_factory.mktemp("readme-diffusers")
    path = build("qwen-image-2.1", tmp / "qwen")
    example = diffusers_example()
    for old, new in SWAPS.items():
        assert example.count(old) == 1, f"the README's diffusers example no longer has {old}"
        example = example.replace(old, repr(str(path)) if new is None else new)
    (tmp / "staged.py").write_text(FIXTURE + example + "image.save(__import__('sys').argv[1])\n")
    (tmp / "eager.py").write_text(eager_script(diffusers_example(), path))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])
        ),
        # The images of two processes are compared: the same torch thread count in both.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }

    def python(*argv: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    staged = python(
        "-m",
        "stageload",
        "meter",
        "-o",
        str(tmp / "trace.jsonl"),
        "--",
        sys.executable,
        str(tmp / "staged.py"),
        str(tmp / "staged.png"),
    )
    python(str(tmp / "eager.py"), str(tmp / "eager.png"), str(tmp / "other_seed.png"))
    return tmp, staged.stdout


def test_readme_diffusers_example_prints_its_plan(diffusers_runs):
    _, stdout = diffusers_runs
    shown = re.search(r"print\(pipe\.stageload\.plan\)\s*# (.*)", diffusers_example()).group(1)
    assert shown.strip() in stdout


def test_readme_diffusers_example_loads_each_model_at_its_stage_and_releases_it(diffusers_runs):
    from stageload.report.trace import read_trace

    tmp, _ = diffusers_runs
    events = [
        (e.kind, e.model, e.stage)
        for e in read_trace(tmp / "trace.jsonl").events
        if e.kind in ("load", "release")
    ]
    assert events[:5] == [
        ("load", "text_encoder", "encode"),
        ("release", "text_encoder", "denoise"),
        ("load", "transformer", "denoise"),
        ("release", "transformer", "decode"),
        ("load", "vae", "decode"),
    ]
    assert [m for kind, m, _ in events if kind == "load"] == ["text_encoder", "transformer", "vae"]


def test_readme_diffusers_example_gives_the_eager_image_bit_for_bit(diffusers_runs):
    """Reference: eager (``from_pretrained``) in its own process; torch on one thread in both
    processes (see ``diffusers_runs``)."""
    tmp, _ = diffusers_runs
    assert pixels(tmp / "staged.png") == pixels(tmp / "eager.png")


def test_control_the_image_comparison_tells_another_seed_apart(diffusers_runs):
    tmp, _ = diffusers_runs
    assert pixels(tmp / "other_seed.png") != pixels(tmp / "eager.png")


# -- the auto example --------------------------------------------------------------------

#: As ``SWAPS``, and a budget that holds no component (each released between its uses).
AUTO_SWAPS = {
    '"Qwen/Qwen-Image-2.1"': None,
    'stageload.auto(budget="12G")': "stageload.auto(budget=1, events=SINK)",
    "num_inference_steps=20": SMALL_CALL,
}


def auto_example(path: Path, staged: bool = True, seed: int | None = None) -> str:
    example = next(b for b in blocks("python") if "stageload.auto(" in b)
    for old, new in AUTO_SWAPS.items():
        assert example.count(old) == 1, f"the README's auto example no longer has {old}"
        example = example.replace(old, repr(str(path)) if new is None else new)
    if not staged:
        example = example.replace("stageload.auto(budget=1, events=SINK)", "nullcontext()")
    if seed is not None:
        example = re.sub(r"manual_seed\(\d+\)", f"manual_seed({seed})", example)
    return FIXTURE + "from contextlib import nullcontext\n" + example


def test_readme_auto_example_gives_the_eager_image_bit_for_bit(tmp_path, one_thread):
    """Reference: the same code without ``stageload.auto``, in this process, on the same
    torch threads (one); each component released between its uses and loaded again."""
    pytest.importorskip("diffusers")
    from stageload import ListSink
    from stageload.testing.diffusers import build

    path = build("qwen-image-2.1", tmp_path / "qwen")
    sink = ListSink()
    staged = {"__name__": "readme", "SINK": sink}
    run_example(auto_example(path), staged)
    eager = {"__name__": "readme"}
    run_example(auto_example(path, staged=False), eager)
    other = {"__name__": "readme"}
    run_example(auto_example(path, staged=False, seed=8), other)
    assert staged["image"].tobytes() == eager["image"].tobytes()
    assert other["image"].tobytes() != eager["image"].tobytes()  # control: the check tells
    # Room for one component at a time: each is read at its first use (from_pretrained
    # read none), and the one before it goes first.
    moves = [(e.kind, e.model) for e in sink.events if e.kind in ("load", "release")]
    assert moves == [
        ("load", "text_encoder"),
        ("release", "text_encoder"),
        ("load", "transformer"),
        ("release", "transformer"),
        ("load", "vae"),
    ]


# -- the commands ------------------------------------------------------------------------


def test_readme_starts_with_the_demo_and_the_test_command():
    first = blocks("bash")[0]
    assert "stageload demo" in first
    assert "pytest" in first
    ci = (ROOT / ".ci" / "run").read_text()
    tests = "python -m pytest -q -n 2 --dist loadfile"  # CI runs what the README says
    assert f"ruff check . && {tests}" in first
    assert "ruff check ." in ci.splitlines() or "if ! ruff check .; then" in ci
    assert tests in {_command(line) for line in ci.splitlines()}


def _command(line: str) -> str:
    """A shell line's command, without the variables it sets for it (``A=b cmd``)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return ""
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        words.pop(0)
    return " ".join(words)


def commands(text: str) -> list[list[str]]:
    """Each simple command of the page's bash blocks, split as the shell splits it."""
    found = []
    for block in blocks("bash", text):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                found.append(words[:end])
                words = words[end + 1 :]
    return found


def command_problems(text: str) -> list[str]:
    """What is wrong with the page's ``stageload`` and ``pip install`` commands: a flag the
    CLI does not have, an extra pyproject.toml does not define."""
    from stageload.cli import build_parser
    from stageload.pixal3d.cli import build_parser as pixal3d_parser

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomllib came in 3.11
        tomllib = pytest.importorskip("tomli")
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    problems = []
    for argv in commands(text):
        if argv[0] in ("stageload", "stageload-pixal3d"):
            parser = build_parser() if argv[0] == "stageload" else pixal3d_parser()
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    parser.parse_args(argv[1:])
                except SystemExit:
                    problems.append(f"{shlex.join(argv)}: {err.getvalue().strip()}")
        elif argv[:2] == ["pip", "install"]:
            for word in argv[2:]:
                named = re.fullmatch(r"\.\[([\w,]+)\]", word)
                if named and not set(named.group(1).split(",")) <= extras:
                    problems.append(
                        f"{shlex.join(argv)}: no extra {named.group(1)!r} in {sorted(extras)}"
                    )
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_on_the_front_door_parse_with_the_real_cli(page):
    if not page.exists():
        pytest.fail(f"{page} is missing")
    assert command_problems(page.read_text()) == []


def test_readme_shows_commands_to_check():
    ran = [argv[0] for argv in commands(README.read_text())]
    assert ran.count("stageload") >= 6 and "pip" in ran


def test_control_the_command_check_finds_a_flag_and_an_extra_that_do_not_exist():
    page = '```bash\nstageload guard --no-such-flag -- true\npip install ".[nope]"\n```\n'
    problems = command_problems(page)
    assert len(problems) == 2
    assert "--no-such-flag" in problems[0] and "'nope'" in problems[1]


# -- links -------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without its code: fenced blocks and inline code (``models["a"](h)`` is no link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links of ``text`` (read as ``page``) to files or headings that are not there."""
    problems = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, fragment = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            problems.append(f"{target}: no such file")
            continue
        if fragment and path.suffix == ".md":
            headings = {anchor(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
            if fragment not in headings:
                problems.append(f"{target}: no heading #{fragment} in {path.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_on_the_front_door_point_at_pages_and_headings_that_exist(page):
    assert link_problems(page, page.read_text()) == []


def test_control_the_link_check_finds_a_missing_file_and_a_missing_heading():
    text = "[a](docs/no-such-page.md) [b](docs/guard.md#no-such-heading) [c](docs/guard.md)"
    assert len(link_problems(README, text)) == 2


def test_readme_links_every_feature_page_in_docs():
    links = LINK.findall(prose(README.read_text()))
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links}
    pages = set((ROOT / "docs").glob("*.md"))
    assert sorted(p.name for p in pages - linked) == []


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.encode()) <= README_MAX_BYTES
    # The reader's path: what and why, the commands, the example, diffusers, one result
    # table, the index of features.
    order = ["stageload demo", "StagedModels(", "staged_pipeline(", "## Measured", "## Features"]
    assert [text.index(s) for s in order] == sorted(text.index(s) for s in order)


# -- bench/results -----------------------------------------------------------------------

CITED = re.compile(r"bench/results/[\w./-]*[\w/]")


def cited_results() -> set[str]:
    """Every bench/results path the README, the docs, the source and the tests cite (not the
    benches: they name what they will write, e.g. bench/cuda_release.py's table, not run yet)."""
    texts = [
        *ROOT.glob("*.md"),
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("bench/*.md"),
        *ROOT.glob("src/**/*.py"),
        *(p for p in ROOT.glob("tests/**/*.py") if p != Path(__file__)),  # not this file's controls
    ]
    found = set()
    for path in texts:
        found |= {m.rstrip("/.") for m in CITED.findall(path.read_text())}
    return found


def missing_results(cited: set[str]) -> list[str]:
    """Cited paths with nothing there (``contention-`` names the files that start with it)."""
    return sorted(
        c
        for c in cited
        if not (ROOT / c).exists() and not list((ROOT / c).parent.glob(Path(c).name + "*"))
    )


def test_every_cited_result_exists():
    assert missing_results(cited_results()) == []


def test_control_a_cited_result_that_is_gone_is_found():
    assert missing_results({"bench/results/demo/demo.png", "bench/results/demo/gone.md"}) == [
        "bench/results/demo/gone.md"
    ]


def test_bench_results_keep_tables_and_plots_not_logs():
    logs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").rglob("*.log"))
    assert logs == []


def cited_logs(text: str) -> list[str]:
    """Log files a page names, with or without their folder (docs cite results by name)."""
    return re.findall(r"[\w./-]+\.log\b", text)


def test_docs_cite_tables_not_logs():
    cited = {p.name: cited_logs(p.read_text()) for p in [*ROOT.glob("docs/*.md"), *PAGES]}
    assert {name: logs for name, logs in cited.items() if logs} == {}


def test_control_a_cited_log_is_found():
    assert cited_logs("see `cost.log` and bench/results/load/warm-recheck.log") == [
        "cost.log",
        "bench/results/load/warm-recheck.log",
    ]


# -- CI's load check ---------------------------------------------------------------------


def load_check_tests(text: str) -> list[str]:
    """The tests .ci/run's load check names (``LOAD_TESTS``), ``$AUTO`` expanded."""
    auto = re.search(r"^AUTO=(\S+)$", text, re.M)
    block = re.search(r"^LOAD_TESTS=\((.*?)^\)", text, re.M | re.S)
    assert auto and block, "LOAD_TESTS or AUTO not found in .ci/run"
    return [w.replace("$AUTO", auto.group(1)) for w in shlex.split(block.group(1))]


def missing_tests(names: list[str]) -> list[str]:
    """The names whose file, or whose test in that file, does not exist."""

    def exists(name: str) -> bool:
        path, _, test = name.partition("::")
        file = ROOT / path
        return file.is_file() and (not test or f"def {test}(" in file.read_text())

    return [name for name in names if not exists(name)]


def test_the_ci_load_check_names_tests_that_exist():
    """A renamed test left the load check a pytest usage error ("not found"): CI failed."""
    names = load_check_tests((ROOT / ".ci" / "run").read_text())
    assert len(names) > 10 and not missing_tests(names), missing_tests(names)


def test_control_a_renamed_test_is_missing():
    text = (ROOT / ".ci" / "run").read_text()
    renamed = text.replace("ends_by_sigint_on_ctrl_c", "exits_130_on_ctrl_c")
    assert renamed != text
    assert missing_tests(load_check_tests(renamed))
