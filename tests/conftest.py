"""Make tests/fixtures importable as ``fixtures``, keep test runs offline, and fixtures that
several test modules share."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The tests send SIGINT and SIGHUP to the processes they start and expect them handled. A
# run started under nohup, or as a background job of a script (`cmd &`), inherits those two
# ignored, passes that on to every child, and the guard then rightly leaves them ignored
# (nohup's request): start from the dispositions a terminal gives instead.
if sys.platform != "win32":
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


#: The folder of the ``alone`` locks of a parallel run: made by the main process before
#: it starts the workers (they inherit it), removed when the run ends.
LOCKS = "STAGELOAD_TEST_LOCKS"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "alone: reads the machine's available memory, which another test process moves: in "
        "a parallel run (-n 2), runs while no other test does",
    )
    if not hasattr(config, "workerinput") and LOCKS not in os.environ:
        import tempfile

        os.environ[LOCKS] = tempfile.mkdtemp(prefix="stageload-test-locks-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(LOCKS), ignore_errors=True))


@contextlib.contextmanager
def _turn(item: pytest.Item) -> Iterator[None]:
    """In a parallel run, a test marked ``alone`` runs while no other test does: a lock
    shared by the run's workers, held shared by every other test and exclusively by it.
    A gate taken on the way in keeps an ``alone`` test from waiting forever behind the
    other worker's stream of shared holders."""
    folder = os.environ.get(LOCKS)
    if not hasattr(item.config, "workerinput") or folder is None:  # not a parallel run
        yield
        return
    import fcntl

    alone = item.get_closest_marker("alone") is not None
    with open(f"{folder}/gate", "a") as gate, open(f"{folder}/lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """The whole of a test (its fixtures' setup and teardown too) inside its turn."""
    with _turn(item):
        return (yield)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the imports made, once every test module is imported.

    release() runs one gc.collect() per batch (issue 36): with torch, diffusers and
    transformers imported that walks ~320k objects, 0.15-0.4 s a stage change here, and made
    stage-heavy modules 4x slower (tests/core/test_batch.py 5 s -> 20 s). docs/release.md gives
    users the same advice: objects made before gc.freeze() are never garbage, so every
    collection stays real for the objects the tests make (tests/hooks/test_release_gc.py's
    cycles are made after this).
    """
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _earlier_modules_frozen() -> None:
    """Freeze, as each module starts, what the modules before it left alive.

    Every release runs a gc.collect(), which walks every object not frozen: after
    tests/diffusers/test_diffusers_everyday.py one took 0.19 s, and the stage-change
    interrupt sweep that makes hundreds of them took 269 s after it against 30 s alone (the
    three sweeps: 612 s of a 1228 s suite, p58). What is left alive then is not this
    module's garbage; its own objects stay collectable (the freeze at collection, above)."""
    import gc

    gc.collect()
    gc.freeze()


#: torch's own ``nn.Module.register_parameter`` and ``register_buffer``, once seen.
_REGISTER: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _registration_left_as_torch_has_it() -> Iterator[None]:
    """A test leaves ``nn.Module.register_parameter`` and ``register_buffer`` as torch has
    them. accelerate's ``init_empty_weights`` patches both for every thread, and two at once
    on two threads leave them patched for good: every parameter any later test registers
    goes to meta (a tied T5 embedding built three modules later came out untied, in one run
    of the suite in three). Caught here, the test that did it fails, and no other."""
    yield
    if "torch" not in sys.modules:
        return
    from torch import nn

    changed = []
    for name in ("register_parameter", "register_buffer"):
        now = getattr(nn.Module, name)
        if now.__module__ == "torch.nn.modules.module" and now.__qualname__ == f"Module.{name}":
            _REGISTER.setdefault(name, now)
        elif name in _REGISTER:
            setattr(nn.Module, name, _REGISTER[name])  # the next tests run on torch's own
            changed.append(f"{name} is {now.__qualname__} ({now.__module__})")
    assert not changed, f"the test left nn.Module patched: {'; '.join(changed)}"


#: transformers' own methods and torch's init functions, as first seen (see below).
_TRANSFORMERS: dict[tuple[Any, str], Any] = {}


@pytest.fixture(autouse=True)
def _transformers_left_as_it_has_it() -> Iterator[None]:
    """A test leaves ``PreTrainedModel.tie_weights`` and ``init_weights``, and torch's
    ``nn.init`` functions, as transformers and torch have them. transformers 5's
    ``from_pretrained`` swaps them for empty functions for the whole process while it
    loads (``no_tie_weights``, ``no_init_weights``) and puts back what it found: two loads
    at once on two threads leave the empty ones for good, and every later model in that
    process comes out untied or with new weights left on meta (a T5's embeddings untied
    and a BERT head's bias on meta, four modules later, in one run of the suite). Caught
    here, the test that did it fails, and the next tests run on the real ones."""
    yield
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return
    import torch.nn.init as torch_init

    owners = [(modeling.PreTrainedModel, n) for n in ("tie_weights", "init_weights")]
    owners += [(torch_init, n) for n in ("normal_", "uniform_", "zeros_", "ones_")]
    changed = []
    for owner, name in owners:
        now = owner.__dict__.get(name)
        if (owner, name) not in _TRANSFORMERS:
            if getattr(now, "__name__", "") != "empty_func":
                _TRANSFORMERS[(owner, name)] = now
            continue
        if now is not _TRANSFORMERS[(owner, name)]:
            setattr(owner, name, _TRANSFORMERS[(owner, name)])
            changed.append(f"{getattr(owner, '__name__', owner)}.{name}")
    assert not changed, f"the test left transformers' loading patches: {', '.join(changed)}"


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module's tests (``pytest.mark.usefixtures("one_thread")``):
    tiny models run faster on one thread than on two contended ones."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the Pixal3D stub port (tests/fixtures/pixal3d_stub), for the test_*pixal3d* modules ---------
@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stub port installed as ``Pixal3D-mac`` in a fresh folder, once per module."""
    from fixtures.pixal3d_stub import install_stub

    return install_stub(tmp_path_factory.mktemp("port") / "Pixal3D-mac")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 48x48 noise PNG for the stub port, once per module."""
    from fixtures.pixal3d_stub import write_image

    return write_image(tmp_path_factory.mktemp("input") / "object.png")
