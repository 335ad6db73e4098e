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


def test_a_released_head_model_wrapped_by_peft_reloads_its_mapped_and_new_tensors(folder):
    """peft wraps every Linear of a released classifier (``all-linear``: the new
    classifier becomes ``classifier.base_layer``): the reload maps the renamed base
    weights to their checkpoint keys and puts the classifier back from its kept values.
    Before (helper-48), the classifier's new name was dropped from the mapping and the
    reload left it empty."""
    peft = pytest.importorskip("peft")
    ids = torch.tensor([[5, 6, 7, 8, 9]])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        cls = transformers.BertForSequenceClassification
        model = cls.from_pretrained(f"{folder}/bert").eval()
        other = transformers.AutoModel.from_pretrained(f"{folder}/gpt2").eval()
        with torch.no_grad():
            first = model(input_ids=ids).logits
            other(input_ids=ids)  # room for one: the classifier goes
        torch.manual_seed(5)
        config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        wrapped = peft.get_peft_model(model, config)
        with torch.no_grad():
            return first, wrapped(input_ids=ids).logits

    want = run()
    sink = ListSink()
    with auto(budget=1, events=sink):
        got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [e.note for e in sink.events if e.kind == "reload" and e.model == "bert"] == ["files"]


def test_a_checkpoint_with_a_tensor_under_both_names_reloads_through_its_factory(folder, tmp_path):
    """``x`` and ``bert.x`` both in the file (equal in their first 4 KiB, other values
    after): which one transformers read is its choice for the whole model, not told to
    ``learn``, so the model reloads through its factory, equal to eager. Mapped tensor by
    tensor, its own name first, a BertModel reloaded the other values (helper-48)."""
    from safetensors.torch import load_file, save_file

    (tmp_path / "both").mkdir()
    for f in Path(folder, "bert").iterdir():
        (tmp_path / "both" / f.name).write_bytes(f.read_bytes())
    file = tmp_path / "both" / "model.safetensors"
    state = load_file(file)
    for key, value in list(state.items()):
        other = value.clone()
        if other.nbytes > 4096:
            other.view(-1)[1024:] += 1.0
        state[f"bert.{key}"] = other
    save_file(state, str(file), metadata={"format": "pt"})
    ids = torch.tensor([[5, 6, 7, 8, 9]])

    def run() -> list[torch.Tensor]:
        model = transformers.BertModel.from_pretrained(tmp_path / "both").eval()
        other = transformers.AutoModel.from_pretrained(f"{folder}/gpt2").eval()
        with torch.no_grad():
            return [t for _ in range(2) for t in (model(input_ids=ids)[0], other(input_ids=ids)[0])]

    want = run()
    sink = ListSink()
    with auto(budget=1, events=sink):
        got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [e.note for e in sink.events if e.kind == "reload" and e.model == "both"] == ["factory"]
    assert any("which it read is unknown" in n for n in (e.note or "" for e in sink.events))
