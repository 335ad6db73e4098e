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


def streamed_t5(root: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """Flux with its T5 encoder streamed (its embedding is stored once, ``shared.weight``,
    and tied to ``encoder.embed_tokens``), against the pipeline's own ``from_pretrained``,
    both at ``dtype``, in this process, torch on one thread: (staged pipeline, expected)."""
    fam = FAMILIES["flux"]
    path = folder(fam, root)
    expected = fam.cls.from_pretrained(path, torch_dtype=dtype)(**fam.call(0))[0]
    pipe = staged_pipeline(fam.cls, path, keep=(), stream=["text_encoder_2"], torch_dtype=dtype)
    return pipe, expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_streamed_t5_with_tied_embeddings_equals_eager(root: Path, dtype: str) -> None:
    pipe, expected = streamed_t5(root, getattr(torch, dtype))
    for _ in range(2):
        assert torch.equal(pipe(**FAMILIES["flux"].call(0))[0], expected)
    t5 = pipe.text_encoder_2
    assert t5.shared.weight is t5.encoder.embed_tokens.weight  # tied, as eager's


def test_control_an_untied_skeleton_cannot_stream_the_t5(root: Path, monkeypatch) -> None:
    from transformers import T5EncoderModel

    fam = FAMILIES["flux"]
    path = folder(fam, root)  # saved tied first: the checkpoint holds the embedding once
    monkeypatch.setattr(T5EncoderModel, "tie_weights", lambda self, *a, **k: None)
    with pytest.raises(ValueError, match="missing from the checkpoint: encoder.embed_tokens"):
        staged_pipeline(fam.cls, path, keep=(), stream=["text_encoder_2"])(**fam.call(0))


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
    # A name that cannot be streamed is not offered back as the example.
    with pytest.raises(TypeError, match=r"e.g. \['vae'\]"):
        staged_pipeline(fam.cls, path, stream="scheduler")
    with pytest.raises(ValueError, match="stream names 'transformer' twice"):
        staged_pipeline(fam.cls, path, stream=["transformer", "transformer"])
