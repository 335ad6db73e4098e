"""Make tests/fixtures importable as ``fixtures``, keep test runs offline, and fixtures that
several test modules share."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for the README's parallel run (``-n 2 --dist loadgroup``): a module's tests
    run in one worker, so its module fixtures (built pipelines, a Ray cluster) are made
    once; the Ray modules share one, so two local clusters never start side by side. The
    marks do nothing in a run without ``-n``."""
    for item in items:
        path = Path(str(item.path))
        group = "ray" if path.parent.name == "ray" else str(path)
        item.add_marker(pytest.mark.xdist_group(group))


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
