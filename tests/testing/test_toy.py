"""The toy pipeline of the Ray tests, run here without Ray: its ``hold=`` gate."""

from __future__ import annotations

import pytest
import torch

from stageload.testing.ray import make_toy


def test_a_call_through_an_open_gate_equals_one_that_holds_nothing(tmp_path) -> None:
    pipe = make_toy(width=8)
    (tmp_path / "open").touch()
    held = pipe(1.0, generator=torch.Generator().manual_seed(0), hold=str(tmp_path))
    free = pipe(1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(held, free)
    assert not list(tmp_path.glob("busy-*"))  # an open gate holds no one


def test_hold_refuses_a_value_that_is_no_folder(tmp_path) -> None:
    pipe = make_toy(width=8)
    with pytest.raises(TypeError, match=r"hold= takes a folder .* got 3"):
        pipe(1.0, hold=3)
    with pytest.raises(FileNotFoundError, match="hold= names no folder"):
        pipe(1.0, hold=str(tmp_path / "missing"))
