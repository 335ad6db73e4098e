"""A base model's checkpoint loaded into a model with a head, the everyday fine-tuning
load (``AutoModelForSequenceClassification.from_pretrained("bert-base")``), and a base
model loaded from a checkpoint with a head: transformers maps the names across the base
prefix (``bert.``) and makes the missing tensors new (the classifier). Under auto such a
model reloads from its files, its new tensors kept as the first load made them; it
reloaded through ``from_pretrained`` before, which printed transformers' load report and
read the whole folder again at each reload, and its note called 41 tensors missing where
2 were.

Reference: the same calls without auto, in this process, torch's default threads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stageload.autostage
from fixtures import auto_transformers
from stageload import ListSink, auto
from stageload.load import refill

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("heads"))
    auto_transformers.build(path)
    torch.manual_seed(1)  # its MLM head: drawn here, saved
    transformers.BertForMaskedLM.from_pretrained(f"{path}/bert").save_pretrained(f"{path}/mlm")
    return path


def _calls(folder: str, cls: str, name: str) -> list[torch.Tensor]:
    """Three calls of the model, each followed by a GPT-2's (room for one: it reloads)."""
    torch.manual_seed(0)  # the classifier's new weights: drawn at from_pretrained
    model = getattr(transformers, cls).from_pretrained(f"{folder}/{name}").eval()
    other = transformers.AutoModel.from_pretrained(f"{folder}/gpt2").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    outs = []
    with torch.no_grad():
        for _ in range(3):
            out = model(input_ids=ids)
            outs.append(getattr(out, "logits", None) if cls.startswith("Auto") else out[0])
            other(input_ids=ids)
    return outs


CASES = [("AutoModelForSequenceClassification", "bert"), ("BertModel", "mlm")]


@pytest.mark.parametrize("made_new", [True, False], ids=["mapped", "control"])
@pytest.mark.parametrize(("cls", "name"), CASES, ids=["head-on-base", "base-from-head"])
def test_a_model_its_loader_mapped_reloads_from_its_files(folder, cls, name, made_new, monkeypatch):
    """Equal to eager either way; with the mapping learned its reloads read the files
    (and may load ahead). Control: learned without it (``made_new=False``), it reloads
    through its factory, as before."""
    if not made_new:
        learn = refill.learn
        monkeypatch.setattr(
            stageload.autostage, "learn", lambda *a, **k: learn(*a, **{**k, "made_new": False})
        )
    want = _calls(folder, cls, name)
    sink = ListSink()
    with auto(budget=1, events=sink):
        got = _calls(folder, cls, name)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    reloads = [e.note for e in sink.events if e.kind == "reload" and e.model == name]
    assert reloads == (["files"] * 2 if made_new else ["factory"] * 2)


def test_new_tensors_over_an_eighth_of_the_model_are_not_kept(folder):
    """The new tensors' values stay in memory while the model is released: up to
    ``NEW_KEPT`` of its bytes. A classifier of 2,000 labels on the tiny BERT is about half
    of it: not kept, and the reason names it; with 2 labels the recipe keeps it."""
    files = sorted(Path(folder, "bert").glob("*.safetensors"))
    cls = transformers.AutoModelForSequenceClassification
    big = cls.from_pretrained(f"{folder}/bert", num_labels=2000)
    why = refill.learn(big, files, made_new=True)
    assert isinstance(why, str) and "classifier.weight" in why, why
    recipe = refill.learn(cls.from_pretrained(f"{folder}/bert"), files, made_new=True)
    assert not isinstance(recipe, str), recipe
    assert {"classifier.weight", "classifier.bias"} <= recipe.computed.keys()
    assert recipe.names["bert.embeddings.word_embeddings.weight"] == (
        "embeddings.word_embeddings.weight"
    )
