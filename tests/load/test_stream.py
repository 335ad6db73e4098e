"""stageload.streamed: a model read block by block from its checkpoint at each call.

Real modules, real safetensors files, real memory cgroups. Each claim has its control: the
model that runs streamed under a limit is OOM-killed there when loaded eagerly (and runs
eagerly without the limit); a batch that reads each block once is compared with the same
calls run one after another, which read every block once per call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from stageload import (
    CheckpointError,
    ListSink,
    StagedModels,
    StreamError,
    from_safetensors,
    load_weights,
    release,
    stream_of,
    streamed,
)
from stageload.core.events import BLOCK
from stageload.hooks.registry import HOOKS_ATTR
from stageload.load.stream import Stream
from stageload.testing.blocks import BlockStack, block_bytes, save_block_stack
from stageload.testing.cgroup import cgroup_or_skip

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
MiB = 1 << 20

WIDTH, DEPTH, FEATURES = 128, 5, 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "stack.safetensors"
    save_block_stack(path, width=WIDTH, depth=DEPTH, features=FEATURES, seed=0)
    return path


def build() -> BlockStack:
    return BlockStack(WIDTH, DEPTH, FEATURES)


def x_of(i: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, FEATURES, generator=torch.Generator().manual_seed(100 + i))


def resident_bytes(model: nn.Module) -> int:
    """The memory the model's tensors hold: their storages' bytes (a tensor placed at its
    file offset mod 64, stageload.load.placement, sits in up to 64 bytes more)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in model.state_dict().values()
        if not t.is_meta
    }
    return sum(storages.values())


# -- one call ----------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_streamed_output_is_bit_identical_to_eager(stack: Path, prefetch, dtype) -> None:
    """Reference: ``from_safetensors`` (every tensor placed as ``load_state_dict`` puts it, as
    the stream does) in this process, with this process's torch threads on both sides."""
    eager = from_safetensors(build, stack, dtype=dtype)()
    model = streamed(build, stack, prefetch=prefetch, dtype=dtype)
    x = x_of(0).to(dtype or torch.float32)
    with torch.no_grad():
        want = eager(x)
        first, second = model(x), model(x)  # the second call reads every block again
    assert torch.equal(first, want) and torch.equal(second, want)
    assert first.dtype == want.dtype
    stats = stream_of(model).stats
    itemsize = 2 if dtype is not None else 4
    assert stats.blocks_loaded == 2 * DEPTH
    assert stats.bytes_read == 2 * DEPTH * block_bytes(WIDTH, itemsize)
    # Control: a different input gives a different output (the comparison can fail).
    with torch.no_grad():
        assert not torch.equal(model(x_of(1).to(x.dtype)), want)


def test_at_most_one_block_in_use_and_one_read_ahead(stack: Path) -> None:
    """Inside each block's forward: only that block is loaded, and with prefetch only the
    next one is being read; after the call no block is left."""
    seen: list[tuple[list[str], int | None]] = []

    def record(stream) -> None:
        pending = stream._pending
        seen.append((stream.resident(), None if pending is None else pending.index))

    for prefetch in (True, False):
        seen.clear()
        model = streamed(build, stack, prefetch=prefetch)
        stream = stream_of(model)
        for block in model.blocks:
            block.up.register_forward_pre_hook(lambda *_, s=stream: record(s))
        rest = resident_bytes(model)
        with torch.no_grad():
            model(x_of(0))
        assert [r for r, _ in seen] == [[f"blocks.{i}"] for i in range(DEPTH)]
        ahead = [p for _, p in seen]
        if prefetch:
            assert ahead == [*range(1, DEPTH), None]
        else:  # control: without prefetch, nothing is read ahead
            assert ahead == [None] * DEPTH
        assert stream.resident() == [] and resident_bytes(model) == rest
        assert all(t.is_meta for t in model.blocks.state_dict().values())


def test_the_block_list_is_found_or_named(stack: Path, tmp_path: Path) -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.big = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    from safetensors.torch import save_file

    save_file(Two().state_dict(), tmp_path / "two.safetensors")
    default = stream_of(streamed(Two, tmp_path / "two.safetensors"))
    assert default.paths_of_blocks == ["big.0", "big.1"]  # the most parameters
    named = stream_of(streamed(Two, tmp_path / "two.safetensors", blocks="small"))
    assert named.paths_of_blocks == ["small.0", "small.1", "small.2"]
    both = stream_of(streamed(Two, tmp_path / "two.safetensors", blocks=["small", "big"]))
    assert len(both.paths_of_blocks) == 5
    with pytest.raises(StreamError, match=r"no non-empty .* at 'layers'.*'small' \(3 x"):
        streamed(Two, tmp_path / "two.safetensors", blocks="layers")
    save_file(nn.Linear(2, 2).state_dict(), tmp_path / "flat.safetensors")
    with pytest.raises(StreamError, match="has no nn.ModuleList"):
        streamed(lambda: nn.Linear(2, 2), tmp_path / "flat.safetensors")


def test_a_checkpoint_that_does_not_fit_fails_at_build(stack: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        streamed(lambda: BlockStack(WIDTH, DEPTH, FEATURES * 2), stack)
    # Control: the right config builds.
    assert streamed(build, stack) is not None


def test_a_failed_read_ahead_surfaces_at_that_blocks_call(
    stack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetch thread's error (here a disk's I/O error on its read of block 1) is raised
    by the call that needs the block, naming it; the block before it ran."""
    model = streamed(build, stack)
    read, reads = Stream._read, []

    def failing(self: Stream, planned: Any) -> Any:
        reads.append(planned)
        if len(reads) == 2:  # block 0 read at its call, block 1 read ahead
            raise OSError(5, "Input/output error")
        return read(self, planned)

    monkeypatch.setattr(Stream, "_read", failing)
    with torch.no_grad(), pytest.raises(StreamError, match=r"reading block 'blocks.1'.*I/O|Input"):
        model(x_of(0))
    assert stream_of(model).stats.blocks_loaded == 1  # block 0 was read and ran


@pytest.mark.parametrize("change", ["truncated", "saved over"])
def test_a_file_changed_after_build_is_said_not_read_at_old_offsets(
    stack: Path, tmp_path: Path, change: str
) -> None:
    """The offsets read at build would read other bytes: the next block's read raises,
    naming the file, before it reads (a new-user helper got a mix of old and new weights,
    or NaN, with no word). Control: the same model, file untouched, runs."""
    path = tmp_path / "changing.safetensors"
    path.write_bytes(stack.read_bytes())
    model = streamed(build, path)
    with torch.no_grad():
        want = model(x_of(0))
        assert torch.equal(model(x_of(0)), want)
    if change == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    else:
        save_block_stack(path, width=WIDTH, depth=DEPTH, features=FEATURES, seed=1)
    with torch.no_grad(), pytest.raises(CheckpointError, match=r"changing.safetensors: .* since"):
        model(x_of(0))


def test_a_relative_path_streams_from_the_file_it_named_after_a_chdir(
    stack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reference: ``from_safetensors`` of the same file, this process. Another file of the
    same name, with other weights, in the folder the script moves to."""
    for folder, seed in (("a", 0), ("b", 1)):
        (tmp_path / folder).mkdir()
        save_block_stack(
            tmp_path / folder / "m.safetensors",
            width=WIDTH,
            depth=DEPTH,
            features=FEATURES,
            seed=seed,
        )
    monkeypatch.chdir(tmp_path / "a")
    model = streamed(build, "m.safetensors")
    want = from_safetensors(build, "m.safetensors")()
    monkeypatch.chdir(tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(model(x_of(0)), want(x_of(0)))


def test_a_block_the_checkpoint_does_not_fit_fails_at_build(stack: Path, tmp_path: Path) -> None:
    """Not at the call that reaches it, and with no offer of a strict=False streamed lacks."""
    path = tmp_path / "short.safetensors"
    tensors = load_file(stack)
    del tensors["blocks.2.down.bias"]
    save_file(tensors, path)
    with pytest.raises(StreamError, match="(?s)blocks.2.*missing.*: down.bias") as err:
        streamed(build, path)
    assert "strict" not in str(err.value)


def test_a_copy_streams_on_its_own_and_a_release_stops_the_read_ahead(stack: Path) -> None:
    """``copy.deepcopy`` after a call (the read-ahead thread existed: 'cannot pickle
    SimpleQueue'); the copy equals the original. Released as a whole, the model's read-ahead
    thread is joined: left to the garbage collector, its finalizer ran in the release's
    gc.collect(), where a Ctrl-C was lost."""
    import copy

    model = streamed(build, stack)
    with torch.no_grad():
        want = model(x_of(0))
        twin = copy.deepcopy(model)
        assert torch.equal(twin(x_of(0)), want)
    assert stream_of(twin) is not stream_of(model)
    stream = stream_of(model)
    assert stream._executor is not None  # a read ahead ran
    release(model)
    assert stream._executor is None


def test_grad_mode_with_an_input_that_requires_grad_is_refused(stack: Path) -> None:
    model = streamed(build, stack)
    x = x_of(0).requires_grad_(True)
    with pytest.raises(StreamError, match="no_grad"):
        model(x)
    assert all(not p.requires_grad for p in model.parameters())
    # Control: the same input without autograd runs.
    with torch.no_grad():
        assert model(x).shape == x.shape


def test_a_block_left_loaded_by_an_error_is_freed_by_the_next_call(stack: Path) -> None:
    model = streamed(build, stack, prefetch=False)
    stream = stream_of(model)
    fail = {"on": True}

    def boom(*_: object) -> None:
        if fail["on"]:
            raise RuntimeError("boom")

    model.blocks[2].down.register_forward_pre_hook(boom)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(x_of(0))
    assert stream.resident() == ["blocks.2"]  # its post_call never ran
    fail["on"] = False
    with torch.no_grad():
        model(x_of(0))
    assert stream.resident() == []


def test_block_events_and_hooks_set_nothing_else(stack: Path) -> None:
    sink = ListSink()
    plain = build()
    before = {n: set(vars(m)) for n, m in plain.named_modules()}
    model = streamed(build, stack, name="stack", events=sink)
    added = {k for n, m in model.named_modules() for k in set(vars(m)) - before[n]}
    assert added == {HOOKS_ATTR, "forward"}  # the one hook protocol's attributes only
    with torch.no_grad():
        model(x_of(0))
    blocks = sink.kinds(BLOCK)
    assert [e.note.split()[0] for e in blocks] == [f"blocks.{i}" for i in range(DEPTH)]
    assert all(e.model == "stack" and e.bytes == block_bytes(WIDTH) for e in blocks)
    assert all(e.compute is not None and e.compute > 0 and e.seconds > 0 for e in blocks)
    assert [("(prefetched)" in e.note) for e in blocks] == [False] + [True] * (DEPTH - 1)


# -- buffers: built for real, parameters on meta -------------------------------------------


def frequencies(width: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(width, dtype=torch.float32) / width))


class RopeBlock(nn.Module):
    """A block with a buffer it computes (not saved) and one the checkpoint holds."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("phase", torch.linspace(0, 1, width), persistent=False)
        self.register_buffer("shift", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sin(self.linear(x) + self.phase) + self.shift


class RopeStack(nn.Module):
    """Computed ``pos_freqs`` outside the blocks, as the Pixal3D flow models have."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(RopeBlock(width) for _ in range(depth))
        self.register_buffer("pos_freqs", frequencies(width), persistent=False)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x)) * self.scale + torch.cos(x * self.pos_freqs)
        for block in self.blocks:
            h = block(h)
        return h


@pytest.fixture(scope="module")
def rope(tmp_path_factory) -> Path:
    """RopeStack's checkpoint; its persistent buffers differ from what __init__ makes."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = RopeStack().state_dict()
    for key in state:
        if key.endswith(("shift", "scale")):
            state[key] = torch.randn(state[key].shape)
    path = tmp_path_factory.mktemp("rope") / "rope.safetensors"
    save_file(state, path)
    return path


def rope_eager(path: Path) -> RopeStack:
    model = RopeStack()  # built for real on the CPU, as a port builds it, then filled
    load_weights(model, path)
    return model


def test_computed_buffers_are_built_for_real_and_stream_bit_identical(rope: Path) -> None:
    """Reference: the model built on the CPU and filled by ``load_weights``, in this process,
    same torch threads."""
    eager = rope_eager(rope)
    model = streamed(RopeStack, rope, prefetch=False)
    x = x_of(0, rows=3)[:, :16]
    with torch.no_grad():
        want = eager(x)
        first, second = model(x), model(x)  # the second: every block read again
    assert torch.equal(first, want) and torch.equal(second, want)
    assert stream_of(model).stats.blocks_loaded == 6
    assert torch.equal(model.pos_freqs, frequencies(16))
    # The persistent buffers came from the checkpoint, not from __init__.
    assert torch.equal(model.scale, eager.scale) and not torch.equal(model.scale, torch.ones(16))
    # Between calls each block's checkpoint tensors are freed; its computed buffer stays,
    # since no read could give it back.
    block = model.blocks[1]
    assert block.linear.weight.is_meta and block.shift.is_meta
    assert torch.equal(block.phase, torch.linspace(0, 1, 16))
    # Control: built wholly on meta (as from_safetensors builds), the computed buffers
    # are meta tensors that nothing fills.
    with pytest.raises(ValueError, match=r"still on meta[\s\S]*pos_freqs"):
        from_safetensors(RopeStack, rope)()


def test_building_draws_no_random_numbers_and_keeps_no_weights(rope: Path) -> None:
    state = torch.get_rng_state()
    model = streamed(RopeStack, rope)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(t.is_meta for t in model.blocks.state_dict().values())
    # Control: the same constructor built for real draws its initial weights.
    RopeStack()
    assert not torch.equal(torch.get_rng_state(), state)


def test_parameters_go_to_meta_only_on_the_thread_that_asked() -> None:
    """torch's registration hook is global: another thread's model (a StagedModels
    prefetch building a model meanwhile) keeps real weights."""
    import threading

    from stageload.load.meta import meta_parameters

    inside, built = threading.Event(), threading.Event()
    other: list[nn.Module] = []

    def build_elsewhere() -> None:
        inside.wait()
        other.append(nn.Linear(4, 4))
        built.set()

    thread = threading.Thread(target=build_elsewhere)
    thread.start()
    with meta_parameters():
        inside.set()
        built.wait()
        mine = nn.Linear(4, 4)
    thread.join()
    assert mine.weight.is_meta and mine.bias.is_meta
    assert not other[0].weight.is_meta
    assert not nn.Linear(4, 4).weight.is_meta  # and nothing after the block


# -- block-major batches -----------------------------------------------------------------


def read_chars() -> int:
    """Bytes this process read through read()/pread() so far (the kernel's count)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


STEPS = 3


def denoise(models: StagedModels, i: int) -> torch.Tensor:
    """A call of the pipeline: a few steps through the streamed model, seeded noise."""
    models.enter("denoise")
    torch.manual_seed(i)
    h = torch.randn(4, FEATURES)
    with torch.no_grad():
        for _ in range(STEPS):
            h = h - 0.1 * models["stack"](h) + 0.01 * torch.randn(4, FEATURES)
    return h


def staged(stack: Path, sink: ListSink) -> StagedModels:
    return StagedModels(
        {"stack": lambda: streamed(build, stack, name="stack", events=sink)},
        stages={"denoise": ["stack"], "after": []},
        events=sink,
    )


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_a_batch_reads_each_block_once_per_step(stack: Path) -> None:
    """Reference: each call streamed alone (``StagedModels`` without ``map``), in this process,
    same torch threads."""
    per_block = block_bytes(WIDTH)
    # Separate runs: the reference outputs, and the control for what N calls read.
    sink = ListSink()
    alone = staged(stack, sink)
    alone["stack"]  # the parts outside the blocks: read once, not counted below
    start = read_chars()
    want = [denoise(alone, i) for i in range(4)]
    separate = read_chars() - start
    assert stream_of(alone["stack"]).stats.bytes_read == 4 * STEPS * DEPTH * per_block

    read: dict[int, int] = {}
    for n in (1, 4):
        sink = ListSink()
        models = staged(stack, sink)
        models["stack"]
        start = read_chars()
        got = models.map(lambda i, m=models: denoise(m, i), range(n))
        read[n] = read_chars() - start
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=False))  # per call
        stats = stream_of(models["stack"]).stats
        assert stats.blocks_loaded == STEPS * DEPTH  # once per block per step, whatever n
        assert stats.bytes_read == STEPS * DEPTH * per_block
        assert len(sink.kinds(BLOCK)) == STEPS * DEPTH
    # The kernel's count agrees: N = 4 reads what N = 1 reads (headers, a few KiB, aside)...
    assert STEPS * DEPTH * per_block <= read[1] < STEPS * DEPTH * per_block + MiB
    assert read[4] <= read[1] + MiB
    # ...and the control, the same four calls one after another, reads four times as much.
    assert separate >= 4 * STEPS * DEPTH * per_block > 3 * read[4]


def test_a_batch_with_uneven_calls_serves_blocks_before_the_next_stage(stack: Path) -> None:
    """Calls that stop early wait at the next stage while the others finish their steps;
    every call's output stays its own. Reference: the same calls in turn, each streamed
    alone (``StagedModels`` without ``map``), in this process, same torch threads."""

    def uneven(models: StagedModels, i: int) -> torch.Tensor:
        models.enter("denoise")
        torch.manual_seed(i)
        h = torch.randn(2, FEATURES)
        with torch.no_grad():
            for _ in range(1 + i):
                h = models["stack"](h) + torch.randn(2, FEATURES)
        models.enter("after")
        return h

    sink = ListSink()
    alone = staged(stack, sink)
    want = [uneven(alone, i) for i in range(3)]
    sink = ListSink()
    models = staged(stack, sink)
    got = models.map(lambda i: uneven(models, i), range(3))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    blocks = sink.kinds(BLOCK)
    assert len(blocks) == 3 * DEPTH  # the longest call's steps: each block once per step
    stages = [e.stage for e in sink.kinds("stage")]
    assert stages == ["denoise", "after"]  # entered once each, blocks all served before


# -- larger than memory -------------------------------------------------------------------


def run_child(cg, mode: str, checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The outputs of two processes are compared: the same torch thread count in both, on
    # any machine (a kernel's reduction order may follow the thread count).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    args = [PY, "-m", "stageload.testing.blocks", mode, str(checkpoint), str(out)]
    return cg.run(args, timeout=300, env=env)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory cgroups are Linux only")
def test_a_model_larger_than_its_cgroup_runs_streamed_where_eager_is_oom_killed(
    tmp_path: Path,
) -> None:
    """Reference: ``from_safetensors`` in a child process without the limit. Both children run
    torch on one thread (``OMP_NUM_THREADS=1``): outputs cross processes."""
    width, depth = 2048, 12  # 12 blocks of 32 MiB: 384 MiB of weights
    checkpoint = tmp_path / "big.safetensors"
    save_block_stack(checkpoint, width=width, depth=depth, features=64, seed=0)
    model_bytes = checkpoint.stat().st_size
    limit = 320 * MiB  # below the weights alone; the interpreter and torch take ~150 MiB
    assert model_bytes > limit

    # Reference and control: eager, without a tight limit, runs and writes its output.
    with cgroup_or_skip(4 << 30) as free:
        ok = run_child(free, "eager", checkpoint, tmp_path / "eager.pt")
    assert ok.returncode == 0, ok.stderr
    want = torch.load(tmp_path / "eager.pt")

    with cgroup_or_skip(limit) as small:
        killed = run_child(small, "eager", checkpoint, tmp_path / "eager-small.pt")
    assert killed.oom_killed, (killed.returncode, killed.stderr[-2000:])
    assert not (tmp_path / "eager-small.pt").exists()

    with cgroup_or_skip(limit) as small:
        run = run_child(small, "streamed", checkpoint, tmp_path / "streamed.pt")
    assert run.returncode == 0 and not run.oom_killed, run.stderr[-2000:]
    assert run.usage.oom_kills == 0
    got = torch.load(tmp_path / "streamed.pt")
    assert torch.equal(got, want)  # bit-identical to the unconstrained eager run
    stats = json.loads(run.stdout.strip().splitlines()[-1])["stats"]
    assert stats["blocks_loaded"] == depth
    assert stats["bytes_read"] == depth * block_bytes(width)
    # Its own peak footprint (the cgroup's peak also counts page cache, reclaimed at the
    # limit; VmHWM counts library pages charged elsewhere) stayed
    # below the limit and the model; eager's own peak was above both.
    peak = json.loads(run.stdout.strip().splitlines()[-1])["peak_footprint"]
    eager_peak = json.loads(ok.stdout.strip().splitlines()[-1])["peak_footprint"]
    assert peak < limit < model_bytes < eager_peak


def test_the_report_rolls_block_events_up_per_model(stack: Path, tmp_path: Path) -> None:
    """A real streamed run's events in a trace: the report counts its blocks, bytes read,
    and seconds read and computed, per streamed model."""
    from stageload.core.events import Event
    from stageload.meter.tracefile import TraceWriter
    from stageload.report.tables import format_report
    from stageload.report.trace import load_summary

    sink = ListSink()
    path = tmp_path / "stream.jsonl"
    with TraceWriter(path) as writer:
        writer.start(pid=1, meta={"label": "streamed"})  # before the events: t >= 0
        writer.event(Event("stage", stage="denoise"))
        model = streamed(build, stack, name="stack", events=sink)
        with torch.no_grad():
            model(x_of(0))
            model(x_of(1))
        for event in sink.events:
            writer.event(event)
        writer.end()
    summary = load_summary(path)
    blocks = summary.blocks["stack"]
    assert blocks.count == 2 * DEPTH and blocks.bytes == 2 * DEPTH * block_bytes(WIDTH)
    assert blocks.seconds == pytest.approx(sum(e.seconds for e in sink.events), abs=1e-4)
    assert blocks.compute == pytest.approx(sum(e.compute for e in sink.events), abs=1e-4)
    assert summary.to_dict()["blocks"]["stack"]["count"] == 2 * DEPTH
    row = next(r for r in format_report([summary]).splitlines() if "blocks of stack" in r)
    assert f"{2 * DEPTH}: " in row and "read in" in row and "computed" in row
    # Control: a trace without block events has no such row.
    plain = tmp_path / "plain.jsonl"
    with TraceWriter(plain) as writer:
        writer.start(pid=1, meta={"label": "eager"})
        writer.event(Event("stage", stage="denoise"))
        writer.end()
    assert "blocks of" not in format_report([load_summary(plain)])


def test_staged_models_release_and_reload_a_streamed_model(stack: Path) -> None:
    """As one model of a StagedModels: a stage that does not list it releases it (the parts
    outside the blocks; no block is loaded between calls), and the next use builds it anew."""
    sink = ListSink()
    models = staged(stack, sink)
    models.enter("denoise")
    first = models["stack"]
    with torch.no_grad():
        want = first(x_of(0))
    rest = resident_bytes(first)
    models.enter("after")
    (released,) = sink.kinds("release")
    assert released.model == "stack" and released.bytes == rest  # no block was left in memory
    assert resident_bytes(first) == 0
    models.enter("denoise")
    again = models["stack"]
    assert again is not first
    with torch.no_grad():
        assert torch.equal(again(x_of(0)), want)
    # Control: the released object itself refuses a call, as any released model does.
    from stageload import ReleasedModuleError

    with pytest.raises(ReleasedModuleError), torch.no_grad():
        first(x_of(0))


# -- threads ---------------------------------------------------------------------------------
THREADS_SCRIPT = Path(__file__).parents[1] / "fixtures" / "streamed_threads.py"
CLEAN = "equal=120 other=0 errors=0"  # 4 threads x 30 calls, each equal to eager's


def threads_run(tmp_path: Path, *flags: str) -> str:
    """Four threads calling one streamed model at once, in a child process (the control
    corrupts the heap): its exit code and first lines."""
    done = subprocess.run(
        [sys.executable, str(THREADS_SCRIPT), str(tmp_path / "stack.safetensors"), "30", *flags],
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    return f"exit {done.returncode}: " + " | ".join(lines[:2])


def test_threads_calling_one_streamed_model_take_turns_each_equal_to_eager(tmp_path: Path):
    """A server's threads sharing a streamed model: calls run one at a time, in the order
    they began. Reference: eager (``from_safetensors``) in the child, torch on one thread."""
    assert threads_run(tmp_path) == f"exit 0: {CLEAN}"


def test_control_calls_that_do_not_take_turns_break(tmp_path: Path):
    """Without the wait for their turn, calls read blocks into memory another call freed:
    errors (EFAULT, a released block), heap corruption or a segfault (4 of 4 runs)."""
    assert not threads_run(tmp_path, "--no-turn").startswith(f"exit 0: {CLEAN}")
