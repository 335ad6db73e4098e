"""Build a model with no weights in memory but with the buffers its constructor computes.

``torch.device("meta")`` around a constructor puts everything on ``meta``, including the
non-persistent buffers it computes (rotary or positional frequency tables): the checkpoint
does not hold them, so nothing could fill them later. :func:`build_on_meta` instead puts
each *parameter* on ``meta`` as it is registered and lets the constructor compute its
buffers on its usual device; buffers the checkpoint holds (persistent ones) then go to
``meta`` too. What stays in memory is the computed buffers, which are small.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..external import non_persistent_buffers, on_parameter_registration

if TYPE_CHECKING:
    import torch
    from torch import nn

# Per thread: torch's registration hook is global, and another thread may build a model of
# its own meanwhile (a StagedModels prefetch), whose parameters must stay real.
_local = threading.local()


@contextmanager
def meta_parameters() -> Iterator[None]:
    """While the block runs, every parameter a module registers on this thread is put on
    ``meta`` (a ``Parameter`` of the same shape, dtype and ``requires_grad``).

    Initialisers (``reset_parameters``) then run on ``meta`` tensors: no memory, no random
    numbers drawn. A tensor made before it is registered is made for real, briefly
    (``nn.Parameter(torch.empty(...))``: allocated, untouched, dropped), and a constructor
    that draws numbers outside the initialisers (``nn.Parameter(torch.randn(...))``, a
    random buffer) does draw them.
    """
    remove = on_parameter_registration(_to_meta)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        remove()


def _to_meta(module: nn.Module, name: str, param: Any) -> Any:
    from torch.nn.parameter import is_lazy

    if not getattr(_local, "depth", 0) or param is None or param.is_meta or is_lazy(param):
        return None  # another thread's model, an empty slot, or a lazy module's placeholder
    return type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)


def build_on_meta(build: Callable[[], Any]) -> Any:
    """``build()`` with its parameters and persistent buffers on ``meta`` (a checkpoint
    fills them) and its non-persistent buffers as the constructor computed them.

    Returns what ``build()`` returned; the caller checks it is a module."""
    from torch import nn

    with meta_parameters():
        model = build()
    if isinstance(model, nn.Module):
        _checkpointed_to_meta(model)
    return model


def _checkpointed_to_meta(model: nn.Module) -> None:
    """Put every parameter and persistent buffer still off ``meta`` on it (a buffer, or a
    parameter set past ``register_parameter``), keeping tied tensors tied."""
    from torch import nn
    from torch.nn.parameter import is_lazy

    twins: dict[int, torch.Tensor] = {}
    old: list[torch.Tensor] = []  # alive until the end, so no id is reused meanwhile
    for sub in model.modules():
        computed = non_persistent_buffers(sub)
        own = [
            *sub.named_parameters(recurse=False, remove_duplicate=False),
            *sub.named_buffers(recurse=False, remove_duplicate=False),
        ]
        for key, t in own:
            if t.is_meta or key in computed or is_lazy(t):
                continue
            if id(t) not in twins:
                meta = t.detach().to("meta")
                if isinstance(t, nn.Parameter):
                    meta = type(t)(meta, requires_grad=t.requires_grad)
                twins[id(t)] = meta
                old.append(t)
            setattr(sub, key, twins[id(t)])
