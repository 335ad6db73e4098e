"""auto's loads ahead: once the order of the models is recorded, the next stage's models
load in a background thread, as the adapters' policy (``FurthestNextUse``) decides, while
the model in use computes; the script's results and random stream stay as eager's."""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import stageload.autostage  # noqa: E402
from fixtures import auto_ahead  # noqa: E402
from stageload import ListSink  # noqa: E402
from stageload.autostage import auto  # noqa: E402
from stageload.load.checkpoint import CheckpointError  # noqa: E402
from stageload.load.progress import PREFETCH_THREAD  # noqa: E402

FACTORY = "fixtures.auto_ahead:load"
UNIT = auto_ahead.unit_bytes()
#: Room for the denoiser alone, or the encoder beside the decoder: at the decoder's stage
#: the next lap's encoder fits without releasing anything.
BUDGET = int(2.1 * UNIT)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return auto_ahead.save(str(tmp_path_factory.mktemp("ahead")))


def staged(paths: list[str], laps: int, **kwargs: Any) -> tuple[Any, ListSink]:
    sink = ListSink()
    with auto(budget=BUDGET, factories=[FACTORY], defaults=False, events=sink, **kwargs):
        out = auto_ahead.run(paths, laps)
    return out, sink


def loads_of(sink: ListSink, kind: str, name: str) -> int:
    return sum(e.kind == kind and e.model == f"{name}.safetensors" for e in sink.events)


def resident_before_loads(events: list[Any]) -> list[int]:
    """Bytes in memory just after each load or load ahead, replayed from the events."""
    loaded: dict[str, int] = {}
    seen = []
    for e in events:
        if e.kind in ("load", "reload", "prefetch"):
            loaded[e.model] = e.bytes
            seen.append(sum(loaded.values()))
        elif e.kind == "release":
            loaded.pop(e.model, None)
    return seen


def test_the_next_model_loads_ahead_within_the_budget_and_the_output_equals_eager(paths):
    out, sink = staged(paths, laps=4)
    assert torch.equal(out, auto_ahead.run(paths, 4))  # the script draws between models
    # The encoder reloads at its use in laps 1 and 2; lap 2 records the order, and from
    # then on the encoder loads during the decoder's stage, for the next lap (the last one
    # for a lap that never comes).
    assert loads_of(sink, "reload", "encoder") == 2
    assert loads_of(sink, "prefetch", "encoder") == 3
    ahead = [e for e in sink.events if e.kind == "prefetch"]
    assert {e.note for e in ahead} == {"files, for stage 'encoder.safetensors'"}
    # Each load ahead ends before the stage it is for starts: in the trace, it comes
    # right before that stage.
    kinds = [e.kind for e in sink.events]
    assert [kinds[kinds.index("prefetch") + 1]] == ["stage"]
    assert max(resident_before_loads(sink.events)) <= BUDGET
    assert not [t for t in threading.enumerate() if t.name.startswith(PREFETCH_THREAD)]


def test_control_without_loads_ahead_each_reload_is_at_its_use(paths):
    out, sink = staged(paths, laps=4, prefetch=False)
    assert torch.equal(out, auto_ahead.run(paths, 4))
    assert loads_of(sink, "prefetch", "encoder") == 0
    assert loads_of(sink, "reload", "encoder") == 4


def test_control_a_load_ahead_that_draws_moves_the_scripts_stream(paths, monkeypatch):
    """The test above sees a draw on the background thread: with one, the output moves."""
    real = stageload.autostage.reload

    def drawing(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith(PREFETCH_THREAD):
            torch.rand(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(stageload.autostage, "reload", drawing)
    out, sink = staged(paths, laps=4)
    assert loads_of(sink, "prefetch", "encoder") == 3
    assert not torch.equal(out, auto_ahead.run(paths, 4))


def test_a_load_ahead_that_fails_is_said_and_the_use_raises_as_without_it(paths, tmp_path):
    """The encoder's file is damaged after the order is recorded: the load ahead fails on
    its thread (said, the model left released), and the encoder's use raises the error a
    reload at the use raises without loads ahead."""
    errors = []
    for prefetch in (True, False):
        folder = tmp_path / str(prefetch)
        folder.mkdir()
        mine = auto_ahead.save(str(folder))
        sink = ListSink()
        with auto(
            budget=BUDGET, factories=[FACTORY], defaults=False, events=sink, prefetch=prefetch
        ) as session:
            models = [auto_ahead.load(p) for p in mine]
            x = torch.zeros(4, auto_ahead.WIDTH)
            with torch.no_grad():
                for _ in range(2):
                    for model in models:
                        x = model(x)
                Path(mine[0]).write_bytes(Path(mine[0]).read_bytes()[:-64])  # truncated
                models[1](x)  # the denoiser
                models[2](x)  # the decoder: the encoder loads ahead here
                with pytest.raises(CheckpointError) as err:
                    models[0](x)
            errors.append(str(err.value).replace(str(folder), "<folder>"))
            notes = [n for n in session.notes if "a load ahead failed" in n]
            assert len(notes) == (1 if prefetch else 0)
    assert errors[0] == errors[1]
    # Changed on disk since the first read: said before its header is read
    assert "encoder.safetensors: resized and rewritten since" in errors[0]


def edit_during_a_load_ahead(paths: list[str], monkeypatch: Any, *, staged: bool) -> Any:
    """Five laps; after the decoder's call of lap 3 the script scales a row of the
    encoder's first weight (lap 5's encoder is a reload). Staged, the encoder is loading
    ahead then: the edit is made once its tensors are filled, before the load ahead ends
    (held there by the test)."""
    filled, edited, armed = threading.Event(), threading.Event(), threading.Event()
    real = stageload.autostage._convert

    def held(*args: Any, **kwargs: Any) -> Any:
        if armed.is_set() and threading.current_thread().name.startswith(PREFETCH_THREAD):
            armed.clear()
            filled.set()
            assert edited.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(stageload.autostage, "_convert", held)
    sink = ListSink()
    scope = auto(budget=BUDGET, factories=[FACTORY], defaults=False, events=sink)
    with scope if staged else contextlib.nullcontext():
        models = [auto_ahead.load(p) for p in paths]
        torch.manual_seed(0)
        x = torch.randn(4, auto_ahead.WIDTH)
        outs = []
        with torch.no_grad():
            for lap in range(5):
                for i, model in enumerate(models):
                    if staged and (lap, i) == (2, 2):
                        armed.set()  # the decoder's use starts the encoder's load ahead
                    x = model(x)
                    if (lap, i) == (2, 2):
                        assert not staged or filled.wait(30)
                        # One value, between the samples of the values' check
                        # (stageload.load.changes: every 17th of 128 x 128): its version
                        # counter alone tells.
                        models[0].layers[0].weight[1, 3].mul_(2)
                        edited.set()
                outs.append(x)
    return torch.stack(outs), sink


def test_a_write_while_its_model_loads_ahead_is_kept_and_said(paths, monkeypatch):
    out, sink = edit_during_a_load_ahead(paths, monkeypatch, staged=True)
    eager, _ = edit_during_a_load_ahead(paths, monkeypatch, staged=False)
    assert torch.equal(out, eager)
    notes = [e.note for e in sink.events if e.kind == "note"]
    assert any("changed by the script while it loaded ahead" in n for n in notes)


def test_control_without_the_version_check_the_write_is_lost_at_a_reload(paths, monkeypatch):
    monkeypatch.setattr(stageload.autostage, "_written", lambda model, seen, keys: [])
    out, _ = edit_during_a_load_ahead(paths, monkeypatch, staged=True)
    eager, _ = edit_during_a_load_ahead(paths, monkeypatch, staged=False)
    assert not torch.equal(out, eager)


def test_ctrl_c_in_a_release_ahead_of_need_leaves_every_model_usable(tmp_path, monkeypatch):
    """Room for three small models of four (the last twice their size); with the cost
    model off, a load ahead releases models early. A Ctrl-C in the first of those
    releases: no model is left marked releasing or loading, no call is held back, the
    load ahead is not started, and the next calls run within the budget."""
    paths = auto_ahead.save(str(tmp_path))
    real = stageload.autostage.release
    armed = threading.Event()

    def interrupted(module: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != "_look_ahead":
            frame = frame.f_back
        if frame is not None and armed.is_set():
            armed.clear()
            raise KeyboardInterrupt
        return real(module, **kwargs)

    monkeypatch.setattr(stageload.autostage, "release", interrupted)
    order = [paths[0], paths[2], paths[0], paths[1]]  # encoder, decoder, encoder, denoiser
    with auto(budget=int(3.05 * UNIT), factories=[FACTORY], defaults=False) as session:
        session._policy.cost_model = False  # release early whenever it fits
        models = [auto_ahead.load(p) for p in order]
        assert len({id(m) for m in models}) == 3  # the two encoder calls share one
        x = torch.zeros(4, auto_ahead.WIDTH)
        interrupts = 0
        with torch.no_grad():
            for _ in range(4):
                for model in models:
                    armed.set()
                    try:
                        x = model(x)
                    except KeyboardInterrupt:
                        interrupts += 1
        armed.clear()
        assert interrupts >= 1
        states = {m.state for m in session._models.values()}
        assert states <= {"loaded", "released"}
        for model in models:  # a call from another thread is not held back
            t = threading.Thread(target=model, args=(x,))
            t.start()
            t.join(30)
            assert not t.is_alive()
        assert session.resident_bytes() <= session.budget


def test_a_reload_inside_inference_mode_gives_the_weights_as_the_script_made_them(paths):
    """The script converts its models (``.double()``) outside inference_mode and runs them
    inside it; a reload there converts the fresh weights as the first load's mode made
    them, not as inference tensors (the script trains them afterwards, as eager can)."""
    with auto(budget=int(2.1 * UNIT), factories=[FACTORY], defaults=False, prefetch=False):
        models = [auto_ahead.load(p).double() for p in paths]
        x = torch.zeros(4, auto_ahead.WIDTH, dtype=torch.float64)
        with torch.inference_mode():
            for _ in range(2):
                for model in models:
                    x = model(x)
        encoder = models[0]
        weight = encoder.layers[0].weight
        assert weight.dtype == torch.float64 and not weight.is_inference()
        encoder(torch.ones(1, auto_ahead.WIDTH, dtype=torch.float64)).sum().backward()
        assert weight.grad is not None


def test_a_stage_of_several_models_is_one_span_for_the_load_ahead(tmp_path, monkeypatch):
    """A plan source's stage lists the denoiser and the decoder; the load ahead for the
    next stage starts at the denoiser's use and runs on while the decoder, in the same
    stage, is used: the decoder's use does not wait for it (it waited for each model
    change: the load ahead, held here until the decoder's call returns, timed out)."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    encoder, denoiser, decoder = auto_ahead.save(str(first))
    other = auto_ahead.save(str(second))[0]  # a second encoder
    filled, proceed = threading.Event(), threading.Event()
    real = stageload.autostage._convert

    def held(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith(PREFETCH_THREAD) and not filled.is_set():
            filled.set()
            assert proceed.wait(5), "the script waited for the load ahead"
        return real(*args, **kwargs)

    monkeypatch.setattr(stageload.autostage, "_convert", held)
    sink = ListSink()
    with auto(budget=int(4.1 * UNIT), factories=[FACTORY], defaults=False, events=sink) as session:
        session._policy.cost_model = False  # release early whenever it fits: no timing
        models = [auto_ahead.load(p) for p in (other, encoder, denoiser, decoder)]
        second_encoder, first_encoder, den, dec = models
        session.seed([[first_encoder], [den, dec], [second_encoder]], "a test")
        x = torch.zeros(4, auto_ahead.WIDTH)
        with torch.no_grad():
            x = first_encoder(x)
            x = den(x)  # the second encoder starts loading ahead
            assert filled.wait(30)
            x = dec(x)  # same stage: no wait
            proceed.set()
            second_encoder(x)
    assert not [n for n in session.notes if "a load ahead failed" in n]
    assert [e.model for e in sink.events if e.kind == "prefetch"][:1] == ["encoder.safetensors"]


def test_ctrl_c_inside_a_release_leaves_the_model_released_and_the_next_call_works(
    paths, monkeypatch
):
    """A notebook's interrupt lands inside a release, after some tensors went to meta; the
    script catches it and runs again: the model was finished releasing (not taken as
    loaded with meta weights), reloads at its use, and the result equals eager's."""
    import stageload.hooks.release as release_module

    real, calls, armed = release_module._to_meta, [], threading.Event()

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if armed.is_set():
            calls.append(1)
            if len(calls) == 2:  # the release's second tensor: one is on meta already
                raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(release_module, "_to_meta", interrupted)
    with auto(budget=BUDGET, factories=[FACTORY], defaults=False, prefetch=False):
        models = [auto_ahead.load(p) for p in paths]  # the third's build releases the first
        armed.set()
        torch.manual_seed(0)
        x = torch.randn(4, auto_ahead.WIDTH)
        with torch.no_grad():
            with pytest.raises(KeyboardInterrupt):
                for model in models:
                    x = model(x)  # the encoder's reload releases the decoder: interrupted
            assert len(calls) >= 2
            got = [model(torch.ones(2, auto_ahead.WIDTH)) for model in models]
    want_models = [auto_ahead.load(p) for p in paths]
    with torch.no_grad():
        want = [model(torch.ones(2, auto_ahead.WIDTH)) for model in want_models]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def reloads_by_rule(tmp_path: Path) -> tuple[int, list[int], torch.Tensor]:
    """Two models of two units and one of one, room for three units, eight laps with no
    loads ahead: the reloads, the bytes in memory after each load, and the output."""
    paths = auto_ahead.save(str(tmp_path), auto_ahead.UNEQUAL)
    sink = ListSink()
    with auto(
        budget=int(3.05 * UNIT), factories=[FACTORY], defaults=False, events=sink, prefetch=False
    ):
        out = auto_ahead.run(paths, 8)
    reloads = sum(e.kind == "reload" for e in sink.events)
    return reloads, resident_before_loads(sink.events), out


def test_with_unequal_sizes_auto_releases_the_fewest_models_as_the_adapters_policy_does(
    tmp_path,
):
    """Loading a large model beside the other large one and the small one: furthest next
    use first released the small one, then still had to release the large one; the
    adapters' rule (``FurthestNextUse.victims``: the fewest models, then furthest) releases
    the large one alone, and the small one stays loaded for good: two reloads a lap, not
    three."""
    reloads, resident, out = reloads_by_rule(tmp_path)
    assert max(resident) <= 3.05 * UNIT
    assert torch.equal(out, auto_ahead.run(auto_ahead.save(str(tmp_path), auto_ahead.UNEQUAL), 8))
    assert reloads <= 2 * 8 + 1  # one more while the first laps learn the order (17 here)


def test_control_furthest_next_use_first_reloads_three_models_a_lap(tmp_path, monkeypatch):
    def furthest_first(self, idle, holding, name, size):  # auto's rule before
        plan, stage = self.record.plan, self.record.stage
        if plan is None or stage is None:
            return sorted(idle, key=lambda m: m.last_use)
        return sorted(idle, key=lambda m: (-plan.next_use(m.name, stage), m.last_use))

    monkeypatch.setattr(stageload.autostage.AutoSession, "_order", furthest_first)
    reloads, _, _ = reloads_by_rule(tmp_path)
    assert reloads >= 3 * 7  # 24 here


def half_files_staged(tmp_path: Path) -> tuple[Any, ListSink, Any]:
    paths = auto_ahead.save(str(tmp_path), dtype=torch.float16)  # read into float32
    out, sink = staged(paths, 5)
    return out, sink, auto_ahead.run(paths, 5)


def test_a_load_ahead_that_converts_the_files_dtype_is_no_change_by_the_script(tmp_path):
    """float16 files read into a float32 model (``torch_dtype`` other than the files'):
    the conversion goes through the reader's bounce buffer, which must leave the tensors'
    version counters as a plain read does, or every load ahead reads as the script's
    write and the model is kept loaded over the budget."""
    out, sink, want = half_files_staged(tmp_path)
    assert torch.equal(out, want)
    assert sum(e.kind == "prefetch" for e in sink.events) >= 3
    assert [e.note for e in sink.events if e.kind == "note" and "changed" in e.note] == []


def test_control_a_conversion_that_moves_the_version_counter_reads_as_a_write(
    tmp_path, monkeypatch
):
    import stageload.load.reader as reader

    monkeypatch.setattr(reader, "unversioned", lambda t: t)
    _, sink, _ = half_files_staged(tmp_path)
    notes = [e.note for e in sink.events if e.kind == "note"]
    assert any("changed by the script while it loaded ahead" in n for n in notes)


def test_a_conversion_of_a_model_loading_ahead_waits_for_the_load(paths, monkeypatch):
    """``model.to(torch.float64)`` while the model loads ahead (``pipe.to(dtype)`` right
    after a call): the conversion waits for the load, then converts what it loaded. Made
    midway, it converted the tensors just read, and the load's own conversion then undid
    it: mixed dtypes, or a dtype mismatch in the next call. The first load ahead is held
    once its files are read, until the script's conversion has finished or waits."""
    import time

    real = stageload.autostage.reload
    started, converting, converted = threading.Event(), threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    def held(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)  # read: the tensors hold the files' values, not yet converted
        if threading.current_thread().name.startswith(PREFETCH_THREAD) and not started.is_set():
            started.set()
            waiters = box["session"]._bell._tickets  # threads waiting for a state change
            while not converted.is_set() and not (converting.is_set() and waiters):
                time.sleep(0.001)  # polls a state: the script's .to() is done, or waits

    monkeypatch.setattr(stageload.autostage, "reload", held)
    with auto(budget=BUDGET, factories=[FACTORY], defaults=False) as session:
        box["session"] = session
        models = [auto_ahead.load(p) for p in paths]
        x = torch.zeros(4, auto_ahead.WIDTH)
        with torch.no_grad():
            for model in [*models] * 6:
                x = model(x)
                if session._ahead is not None:  # held until the .to() below
                    break
            assert started.wait(60)
            (loading,) = [m for m in session._models.values() if m.state == "loading"]
            target = loading.module()
            converting.set()
            target.to(torch.float64)
            converted.set()
            session._last_ahead.join()  # the load ahead is over
            assert {p.dtype for p in target.parameters()} == {torch.float64}
            path = paths[[m.name for m in session._models.values()].index(loading.name)]
            want = auto_ahead.load(path).double().state_dict()
            got = target.state_dict()
            assert all(torch.equal(got[k], want[k]) for k in want)


# -- torch.autocast on another thread ------------------------------------------------------------
def worker_under_autocast(paths: list[str]) -> tuple[list[Any], list[Any], list[str], list[str]]:
    """A worker thread calls the encoder inside ``torch.autocast`` (bfloat16, grads on), and
    waits in the block while the main thread's decoder needs the encoder's room, then calls
    the encoder again. Returns (the worker's outputs, eager's, the models released, notes)."""

    def calls(models: list[Any], done: threading.Event, used: threading.Event) -> list[Any]:
        out: list[Any] = []

        def worker() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out.append(models[0](x).detach())
                used.set()
                assert done.wait(30)
                out.append(models[0](x).detach())

        thread = threading.Thread(target=worker)
        thread.start()
        assert used.wait(30)
        models[2](x)  # the decoder: on this thread, the encoder's release
        done.set()
        thread.join(60)
        return out

    x = torch.linspace(-1, 1, 4 * auto_ahead.WIDTH).reshape(4, auto_ahead.WIDTH)
    want = calls([auto_ahead.load(p) for p in paths], threading.Event(), threading.Event())
    sink = ListSink()
    with auto(budget=int(1.1 * UNIT), factories=[FACTORY], defaults=False, events=sink):
        models = [auto_ahead.load(p) for p in paths]
        released = len(sink.events)
        got = calls(models, threading.Event(), threading.Event())
    late = sink.events[released:]
    notes = [e.note for e in late if e.kind == "note"]
    return got, want, [e.model for e in late if e.kind == "release"], notes


def test_a_release_on_another_thread_drops_the_autocast_casts_the_worker_made(paths):
    """torch's autocast cache is one for the process (a static behind a mutex in torch
    2.13), so a release on the main thread empties the casts a worker made inside its
    block: the encoder goes, and the worker's next call reloads it, as eager computes."""
    got, want, released, notes = worker_under_autocast(paths)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert "encoder.safetensors" in released, (released, notes)
    assert not [n for n in notes if "held by an autograd graph" in n]


def test_control_with_the_casts_kept_the_worker_holds_the_encoder_loaded(paths, monkeypatch):
    from stageload.hooks import release

    monkeypatch.setattr(stageload.autostage, "drop_autocast_casts", lambda: None)
    monkeypatch.setattr(release, "drop_autocast_casts", lambda: None)
    got, want, released, notes = worker_under_autocast(paths)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert "encoder.safetensors" not in released
    assert [n for n in notes if "encoder.safetensors" in n and "held by an autograd graph" in n]
