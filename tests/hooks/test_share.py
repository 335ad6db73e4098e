"""share(): identical calls return one instance inside the block, and only there."""

from __future__ import annotations

import pytest
from torch import nn

from stageload import release, share
from stageload.hooks.release import is_released


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
        # numpy prints 8 digits: these print alike and differ (the repr shared them)
        near, one = np.array([1.0 + 1e-12]), np.array([1.0])
        assert repr(near) == repr(one)
        assert Factory.make(near) is not Factory.make(one)
        assert Factory.make(one) is Factory.make(np.array([1.0]))  # equal values share


def test_values_equal_across_types_are_different_calls():
    """1, 1.0 and True are equal in Python (one dict key): a factory may build differently
    from each (an int depth, a float scale), so each is its own call, as under auto."""

    class Factory:
        @classmethod
        def make(cls, *args, **kwargs):
            return object()

    with share(Factory, "make"):
        assert len({id(Factory.make(v)) for v in (1, 1.0, True)}) == 3
        assert len({id(Factory.make(scale=v)) for v in (0, 0.0, False)}) == 3
        assert Factory.make(1) is Factory.make(1)


def test_a_backbone_released_with_one_stage_is_rebuilt_for_the_next():
    """The README's case: extractors in different stages that share one backbone. Leaving
    the first stage releases the backbone with its extractor; the second extractor must get
    a fresh one, not the released one back."""
    import torch

    from stageload import StagedModels

    def extractor() -> Extractor:
        return Extractor()

    Backbone.built = 0
    x = torch.randn(2, 8)
    with share(Backbone, "from_pretrained"):
        models = StagedModels(
            {"e1": extractor, "e2": extractor},
            stages={"s1": ["e1"], "s2": ["e2"], "both": ["e1", "e2"]},
        )
        models.enter("s1")
        models["e1"].backbone(x)
        models.enter("s2")  # releases e1, and with it the backbone it built
        models["e2"].backbone(x)  # ReleasedModuleError blaming 'e1' before the fix
        assert Backbone.built == 2
        models.enter("both")  # e2 stays; e1 comes back and shares e2's backbone
        assert models["e1"].backbone is models["e2"].backbone
        models["e1"].backbone(x)
        assert Backbone.built == 2
        models.close()


def test_share_blocks_that_exit_out_of_order_leave_the_class_as_it_was():
    original = vars(Backbone)["from_pretrained"]
    outer, inner = share(Backbone, "from_pretrained"), share(Backbone, "from_pretrained")
    outer_cache = outer.__enter__()
    inner_cache = inner.__enter__()
    first = Backbone.from_pretrained("dinov3")
    assert list(outer_cache.values()) == [first] and list(inner_cache.values()) == [first]
    outer.__exit__(None, None, None)  # out of order: the inner block is still open
    assert Backbone.from_pretrained("dinov3") is first  # still shared by the inner block
    inner.__exit__(None, None, None)
    assert vars(Backbone)["from_pretrained"] is original
    assert Backbone.from_pretrained("dinov3") is not Backbone.from_pretrained("dinov3")


def test_concurrent_identical_calls_build_once():
    """A prefetch thread and the caller asking for the same backbone at once: one build."""
    import threading
    import time

    calls, entered, proceed = [], threading.Event(), threading.Event()

    class Factory:
        @classmethod
        def make(cls, name):
            calls.append(name)
            entered.set()
            proceed.wait(10)
            return object()

    results = []
    with share(Factory, "make"):
        threads = [threading.Thread(target=lambda: results.append(Factory.make("x")))]
        threads[0].start()
        entered.wait(10)
        threads.append(threading.Thread(target=lambda: results.append(Factory.make("x"))))
        threads[1].start()
        time.sleep(0.2)  # give the second caller time to (wrongly) start a build of its own
        proceed.set()
        for thread in threads:
            thread.join(10)
    assert calls == ["x"]
    assert len(results) == 2 and results[0] is results[1]
