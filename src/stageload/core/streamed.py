"""``stageload.streamed``: block streaming (:mod:`stageload.load.stream`) wired to the core.

The mechanism lives in ``load/`` and imports nothing of ``core/``; what it needs from above
is handed in here: the batch a call is part of (``core.batch.current_batch``, a
``MeetingPoint``: under :meth:`StagedModels.map <stageload.StagedModels.map>` the calls
meet at each block, which is then read once for all of them), and where each freed block's
record goes (a ``block`` event to ``events`` and, under ``stageload meter``, the outer
trace).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..load.placement import COPIED, Placement
from ..load.stream import (
    BlockDone,
    Stream,
    StreamError,
    StreamStats,
    find_blocks,
    stream_blocks,
    stream_of,
)
from ..load.weights import Files
from .batch import current_batch
from .events import BLOCK, Event, EventSink
from .outer import outer_trace

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Stream", "StreamError", "StreamStats", "find_blocks", "stream_of", "streamed"]


def streamed(
    build: Callable[[], nn.Module],
    files: Files,
    *,
    blocks: str | Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    prefetch: bool = True,
    name: str | None = None,
    events: EventSink | None = None,
    threads: int | None = None,
    placement: Placement = COPIED,
) -> nn.Module:
    """Build a model on ``meta`` and stream its blocks from ``files`` at each call.

    Everything outside the block list is read now; each block is read when it is called
    and freed right after. The output is bit-identical to
    ``from_safetensors(build, files, dtype=, device=)()``'s, at a peak of the parts outside
    the blocks, two blocks (one with ``prefetch=False``) and the working memory. The
    arguments are :func:`~stageload.load.stream.stream_blocks`', and ``events``: a sink for
    the ``block`` events (each block's read and compute); they also go to the outer trace
    under ``stageload meter``.

    Under :meth:`StagedModels.map <stageload.StagedModels.map>`, calls meet at each block,
    which is then read once for all of them. :func:`stream_of` returns the model's
    :class:`Stream` (its ``stats``, ``close()``).
    """
    return stream_blocks(
        build,
        files,
        blocks=blocks,
        dtype=dtype,
        device=device,
        prefetch=prefetch,
        name=name,
        threads=threads,
        placement=placement,
        meeting=current_batch,
        on_block=_to_events(events),
    )


def _to_events(events: EventSink | None) -> Callable[[BlockDone], None]:
    """Each freed block as a ``block`` event, to ``events`` and the outer trace."""
    outer = outer_trace()  # as at build time: a stream made under `stageload meter`

    def emit(done: BlockDone) -> None:
        event = Event(
            BLOCK,
            model=done.model,
            bytes=done.bytes,
            seconds=done.seconds,
            compute=done.compute,
            note=f"{done.path}{' (prefetched)' if done.prefetched else ''}",
        )
        if events is not None:
            events.emit(event)
        if outer is not None:
            outer.emit(event)

    return emit
