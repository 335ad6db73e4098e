"""share(): identical calls return one instance inside the block, and only there."""

from __future__ import annotations

import pytest
from torch import nn

from stageload import release, share
from stageload.release import is_released


class Backbone(nn.Linear):
    built = 0

    @classmethod
    def from_pretrained(cls, name: str, *, width: int = 8) -> Backbone:
        cls.built += 1
        return cls(width, width)


class Extractor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone.from_pretrained("dinov3", width=8)
        self.proj = nn.Linear(8, 4)


def test_identical_calls_share_one_instance_inside_the_block():
    Backbone.built = 0
    with share(Backbone, "from_pretrained") as cache:
        extractors = [Extractor() for _ in range(4)]
        other = Backbone.from_pretrained("dinov3", width=16)
    assert Backbone.built == 2
    assert len({id(e.backbone) for e in extractors}) == 1
    assert other is not extractors[0].backbone
    assert len(cache) == 2
    # After the block the classmethod is back: each call builds anew.
    assert Backbone.from_pretrained("dinov3") is not Backbone.from_pretrained("dinov3")
    assert isinstance(vars(Backbone)["from_pretrained"], classmethod)


def test_releasing_one_sharer_keeps_the_shared_backbone_for_the_others():
    with share(Backbone, "from_pretrained"):
        a, b = Extractor(), Extractor()
    release(a, name="a", keep=[b])
    assert not is_released(b.backbone)
    assert not b.backbone.weight.is_meta
    assert a.proj.weight.is_meta


def test_share_on_a_module_level_function(tmp_path):
    import types

    mod = types.SimpleNamespace(calls=0)

    def load(path):
        mod.calls += 1
        return object()

    mod.load = load
    with share(mod, "load"):
        assert mod.load("x") is mod.load("x")
    assert mod.calls == 1
    assert mod.load is load


def test_missing_attribute_is_a_clear_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"), share(Backbone, "nope"):
        pass


def test_arguments_that_print_alike_but_differ_are_not_shared():
    """numpy abbreviates large arrays with "...", so two different ones have one repr; and
    a dict argument with keys of mixed types cannot be sorted."""
    np = pytest.importorskip("numpy")

    class Factory:
        @classmethod
        def make(cls, *args, **kwargs):
            return object()

    a, b = np.zeros(2000), np.zeros(2000)
    b[1000] = 1
    assert repr(a) == repr(b)
    with share(Factory, "make"):
        assert Factory.make(a) is not Factory.make(b)
        assert Factory.make(a) is Factory.make(a)
        assert Factory.make([1, 2]) is Factory.make([1, 2])  # short reprs still compare
        options = {1: "a", "x": {2}}
        assert Factory.make(options=options) is Factory.make(options=dict(options))
