"""staged_pipeline(stream=...): a component streamed block by block from its checkpoint
(stageload.streamed) inside a staged pipeline, on locally built Flux and SD pipelines,
equal to eager bit for bit; block-major under pipe.stageload.map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from stageload import ListSink  # noqa: E402
from stageload.diffusers import staged_pipeline  # noqa: E402
from stageload.testing.diffusers import model_bytes  # noqa: E402
from stageload.testing.families import FAMILIES, folder  # noqa: E402

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()


# Tiny models run faster on one thread than on two contended ones (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stream")


def blocks(sink: ListSink) -> list[Any]:
    return [e for e in sink.events if e.kind == "block"]


@pytest.mark.parametrize(("family", "name"), [("flux", "transformer"), ("sd", "unet")])
def test_a_streamed_component_equals_eager(root: Path, family: str, name: str) -> None:
    """Reference: the pipeline's own ``from_pretrained`` (weights left in the file's mmap; the
    stream places its blocks alike, ``placement=MAPPED``), in this process, torch on one
    thread."""
    fam = FAMILIES[family]
    path = folder(fam, root)
    expected = fam.load(path)(**fam.call(0))[0]
    sink = ListSink()
    pipe = staged_pipeline(fam.cls, path, keep=(), stream=[name], events=sink)
    assert all(name not in names for names in pipe.stageload.plan.values())
    for _ in range(2):
        assert torch.equal(pipe(**fam.call(0))[0], expected)
    assert blocks(sink) and {e.model.split(".")[0] for e in blocks(sink)} == {name}
    assert [e.stage for e in sink.kinds("stage")][:3] == ["encode", "denoise", "decode"]
    streamed = getattr(pipe, name)
    held = sum(p.nbytes for p in streamed.parameters() if not p.is_meta)
    assert held < sum(model_bytes(path, [name]).values())  # the blocks are not held


def test_a_batch_reads_each_block_once_per_step(root: Path) -> None:
    """Reference: the same call streamed alone, in this process, torch on one thread."""
    fam = FAMILIES["flux"]
    path = folder(fam, root)
    one, two = ListSink(), ListSink()
    pipe = staged_pipeline(fam.cls, path, keep=(), stream=["transformer"], events=one)
    alone = pipe(**fam.call(0))[0]
    pipe = staged_pipeline(fam.cls, path, keep=(), stream=["transformer"], events=two)
    outs = pipe.stageload.map([fam.call(0), fam.call(1)])
    assert torch.equal(outs[0][0], alone)
    assert len(blocks(two)) == len(blocks(one))  # control below: two single calls read twice
    pipe(**fam.call(1))
    assert len(blocks(two)) == 2 * len(blocks(one))


def test_stream_auto_streams_what_the_budget_cannot_hold(root: Path) -> None:
    fam = FAMILIES["flux"]
    path = folder(fam, root)
    sizes = model_bytes(path)
    budget = max(v for k, v in sizes.items() if k != "transformer") + 1
    assert sizes["transformer"] > budget
    pipe = staged_pipeline(fam.cls, path, keep=(), budget=budget, stream="auto")
    assert all("transformer" not in names for names in pipe.stageload.plan.values())
    assert any("text_encoder" in names for names in pipe.stageload.plan.values())


def test_bad_stream_arguments_say_what_is_wrong(root: Path) -> None:
    fam = FAMILIES["flux"]
    path = folder(fam, root)
    with pytest.raises(ValueError, match="not a model component.*components: .*transformer"):
        staged_pipeline(fam.cls, path, stream=["scheduler"])
    with pytest.raises(ValueError, match="pass budget= too"):
        staged_pipeline(fam.cls, path, stream="auto")
    with pytest.raises(TypeError, match=r"stream must list component names, e.g. \['vae'\]"):
        staged_pipeline(fam.cls, path, stream="vae")
