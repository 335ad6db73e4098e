"""A progress bar on stderr for long weight loads, as diffusers and transformers show.

A staged run reloads its largest model on every call (41 GB, 10-40 s for Qwen-Image 2.1);
without a bar, nothing shows that the run is alive. :func:`load_weights` shows one (the
model's name, bytes, speed) when all of these hold:

- the load reads more than :data:`PROGRESS_MIN_BYTES` (about a second or more);
- stderr is a terminal, or ``STAGELOAD_PROGRESS=1``; ``STAGELOAD_PROGRESS=0`` never;
- the caller allows it (``progress=False``: a diffusers pipeline after
  ``set_progress_bar_config(disable=True)``);
- the load is not a background prefetch (:data:`PREFETCH_THREAD`), which runs while the
  current stage computes and would draw over that stage's own bars.

``tqdm`` is imported only when a bar is shown, so ``import stageload`` stays light.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator

#: Loads of more bytes than this show a bar: 1 GiB takes about a second at disk speed.
PROGRESS_MIN_BYTES = 1 << 30
#: ``1``: show bars even when stderr is not a terminal; ``0``: never show them.
PROGRESS_ENV = "STAGELOAD_PROGRESS"
#: The name prefix of the prefetch thread of ``StagedModels``: loads there show no bar.
PREFETCH_THREAD = "stageload-prefetch"

OnBytes = Callable[[int], None]


def wanted(nbytes: int, *, allowed: bool = True) -> bool:
    """Whether a load of ``nbytes`` on this thread shows a bar (see the module docstring)."""
    setting = os.environ.get(PROGRESS_ENV, "").strip()
    if not allowed or setting == "0" or nbytes <= PROGRESS_MIN_BYTES:
        return False
    if threading.current_thread().name.startswith(PREFETCH_THREAD):
        return False
    if setting == "1":
        return True
    stream = sys.stderr
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


@contextlib.contextmanager
def progress(name: str, nbytes: int, *, allowed: bool = True) -> Iterator[OnBytes | None]:
    """A bar for loading ``nbytes`` of ``name``, if :func:`wanted`; yields the function
    the reader threads call with each chunk's bytes, or None when no bar is shown."""
    if not wanted(nbytes, allowed=allowed):
        yield None
        return
    from tqdm.auto import tqdm

    bar = tqdm(
        total=nbytes,
        desc=f"Loading {name}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    lock = threading.Lock()

    def on_bytes(n: int) -> None:
        # Called from every reader thread; tqdm's counters are not safe to bump at once.
        with lock:
            bar.update(n)

    try:
        yield on_bytes
    finally:
        bar.close()
