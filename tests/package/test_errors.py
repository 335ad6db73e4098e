"""Every exception stageload raises survives pickling: the queue and Ray workers send them
between processes. Python's default (``cls(*args)``) fails for exceptions whose
``__init__`` takes fields, so each one is checked by a round trip."""

from __future__ import annotations

import pickle

import pytest

from stageload import ModelLoadError, ReleasedModuleError
from stageload.guard.process import CannotStartError
from stageload.meter.tracefile import NotAFileError
from stageload.pixal3d.plan import UnsupportedPipelineError
from stageload.report.plot import PlotUnavailableError
from stageload.report.records import TraceError

ERRORS = [
    ReleasedModuleError("e1", "s2"),
    ReleasedModuleError(None, None),
    ModelLoadError("unet", "denoise", OSError(2, "No such file", "/w.safetensors")),
    UnsupportedPipelineError("1536_cascade"),
    TraceError("/tmp/run.jsonl", "line 3 is not JSON"),
    CannotStartError(["no-such-command", "-x"], FileNotFoundError(2, "No such file")),
    PlotUnavailableError(),
    NotAFileError("/tmp/trace.fifo", "a named pipe (FIFO)"),
    NotAFileError("/tmp/plot.png", "a socket", output="image file", why="it is renamed"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_exceptions_survive_a_pickle_round_trip(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error) and back.args == error.args
    fields = {k: v for k, v in vars(error).items() if not isinstance(v, BaseException)}
    assert {k: v for k, v in vars(back).items() if k in fields} == fields  # name, stage, ...
    for key, cause in vars(error).items():  # a cause compares by type and text
        if isinstance(cause, BaseException):
            assert (type(vars(back)[key]), str(vars(back)[key])) == (type(cause), str(cause))


def test_without_reduce_an_exception_with_fields_does_not_unpickle():
    """Control: the same class without the mixin's __reduce__ fails as the review found."""

    class Plain(RuntimeError):
        def __init__(self, name: str, stage: str) -> None:
            self.name, self.stage = name, stage
            super().__init__(f"{name} in {stage}")

    globals()["Plain"] = Plain  # picklable by reference
    Plain.__qualname__ = "Plain"
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(Plain("e1", "s2")))
