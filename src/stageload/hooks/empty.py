"""Empty tensors that load their module when used.

A released module's tensors are meta tensors. Marked by :func:`mark_empty`, each becomes a
meta tensor of a class whose torch functions first ask its owner to fill the module
(``fill_on_use``), metadata reads (``shape``, ``dtype``, ``device``, ...) excepted. An
owner with a ``run_device`` answers ``.device`` with it, and ``.is_meta`` to match when it
sets ``answers_is_meta`` (auto's); under ``torch_function_off`` they are the meta tensors
they are. The
owner fills the same tensor objects in place (``torch.utils.swap_tensors``), so the
function then runs on the loaded values: ``vae.latents_mean`` read by a pipeline, peft's
``fuse_lora`` reading ``base_layer.weight.data``, or a user's
``unet.conv_out.weight.data.mul_(1.5)`` all see (and change) the real weights.

Used by the diffusers adapter's placeholders and by ``stageload.auto``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from ..external import as_subclass, own_tensor_tables, torch_function_off

if TYPE_CHECKING:
    from torch import nn


class Filler(Protocol):
    """What an empty tensor asks: fill your module now (its tensors, in place). An owner
    may also have a ``run_device``: where its module runs, which the empty tensors then
    answer for ``.device`` (``x.to(next(model.parameters()).device)``, the everyday way
    to place inputs, would otherwise put them on ``meta``); and ``loaded``, whether its
    module is loaded: an empty tensor used then was out of the module when it loaded,
    which is an error (:func:`_stray`) rather than a load that fills nothing."""

    #: The module's name, for errors.
    name: str

    def fill_on_use(self) -> None: ...


_METADATA = (
    "is_meta", "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn",
    "layout", "ndim", "names", "is_sparse", "is_quantized", "is_cuda", "is_cpu", "is_mps",
    "is_nested", "is_mkldnn", "itemsize", "nbytes", "_version", "is_inference", "_base",
    "is_floating_point", "is_complex", "size", "dim", "numel", "stride", "element_size",
    "untyped_storage", "data_ptr", "is_contiguous", "storage_offset", "requires_grad_",
    "_is_view", "__len__",
)  # fmt: skip
_OWNER_KEY = "_stageload_unloaded"  # in an empty tensor's __dict__: a weakref to its owner


@functools.cache
def _metadata() -> frozenset[Any]:
    import torch

    out = set()
    for name in _METADATA:
        attr = inspect.getattr_static(torch.Tensor, name, None)
        if attr is None:
            continue
        out.add(attr.__get__ if hasattr(attr, "__set__") or not callable(attr) else attr)
        out.add(getattr(torch.Tensor, name) if callable(getattr(torch.Tensor, name)) else attr)
    # ``p.requires_grad = False`` (freezing a model) sets a flag, as ``requires_grad_`` does:
    # loading for it read every model a script froze before its first use.
    out.add(torch.Tensor.requires_grad.__set__)
    return frozenset(out)


def owner_of(value: Any) -> Filler | None:
    """The owner an empty tensor asks to fill its module, or None."""
    ref = getattr(value, "__dict__", {}).get(_OWNER_KEY)
    return ref() if ref is not None else None


def own_attributes(value: Any) -> dict[str, Any]:
    """The attributes code set on a tensor object (``param.my_tag = ...``), without the
    mark of an empty tensor: what a refill puts back after swapping in new data."""
    return {k: v for k, v in getattr(value, "__dict__", {}).items() if k != _OWNER_KEY}


def _on_use(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A torch function on an empty tensor: unless it reads metadata only, fill first."""
    if func in _metadata():
        return
    values = [*args, *kwargs.values()]
    for value in values:
        if isinstance(value, (list, tuple)):
            values.extend(value)
            continue
        owner = owner_of(value)
        if owner is not None:
            owner.fill_on_use()
            if owner_of(value) is owner and getattr(owner, "loaded", False):
                raise _stray(owner)
            return


def _stray(owner: Filler) -> Exception:
    """The error for an empty tensor of a module its owner says is loaded: the tensor was
    out of the module while it loaded, so nothing filled it (its computation would run
    on ``meta``, and fail there or give meta results)."""
    from ..errors import StageloadError

    return StageloadError(
        f"a tensor of {owner.name} is still empty though the "
        f"model is loaded: it was not in the model when it loaded. Either a call held it "
        f"outside (torch.func.functional_call and torch.nn.utils.stateless swap a model's "
        f"tensors for their call: call the model once before such a call), or the script "
        f"kept it across a release with a weak reference to it, which the load cannot "
        f"fill in place (read the tensor from the model again after its call)"
    )


@functools.cache
def _empty_classes() -> tuple[type, type]:
    """The classes of empty parameters and buffers: meta tensors whose torch functions
    fill their module first (:func:`_on_use`)."""
    import torch
    from torch import nn

    device_get, is_meta_get = torch.Tensor.device.__get__, torch.Tensor.is_meta.__get__

    def __torch_function__(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in (device_get, is_meta_get):
            owner = owner_of(args[0])
            answer = getattr(owner, "run_device", None)
            if answer is not None and func == device_get:
                return answer
            # Not meta, as ``.device`` says, for an owner that answers so: a script's "is
            # my model loaded?" check, or torch's load_state_dict warning that a copy into
            # a meta tensor is a no-op (the copy loads the module first). stageload's own
            # code (the frame that read it) gets the truth.
            if (
                answer is not None
                and getattr(owner, "answers_is_meta", False)
                and not sys._getframe(1).f_globals.get("__name__", "").startswith("stageload.")
            ):
                return answer.type == "meta"
        with torch_function_off():
            _on_use(func, args, kwargs)
            return func(*args, **kwargs)

    def filled_first(name: str) -> Any:
        def method(self: Any, arg: Any) -> Any:
            # A copy (copy.deepcopy) or a pickle (torch.save) is of the loaded tensor: fill
            # first. The fill swaps this object's class back to its plain one, whose own
            # method then runs (the class read before the fill would make the copy an
            # empty tensor holding data).
            owner = owner_of(self)
            if owner is not None:
                owner.fill_on_use()
            if type(self) in (parameter, buffer):  # no owner any more: as a meta tensor
                with torch_function_off():
                    return getattr(base[type(self)], name)(self, arg)
            return getattr(self, name)(arg)

        return method

    members = {
        "__torch_function__": classmethod(__torch_function__),
        "__deepcopy__": filled_first("__deepcopy__"),
        "__reduce_ex__": filled_first("__reduce_ex__"),
    }
    doc = {"__doc__": "An empty tensor of a released module (see stageload.hooks.empty)."}
    parameter = type("EmptyParameter", (nn.Parameter,), {**members, **doc})
    buffer = type("EmptyBuffer", (torch.Tensor,), {**members, **doc})
    base = {parameter: nn.Parameter, buffer: torch.Tensor}
    return parameter, buffer


def mark_empty(module: nn.Module, owner: Filler) -> None:
    """Make each tensor of ``module`` on ``meta`` one whose use asks ``owner`` (held weakly)
    to fill it (the same object: ``torch.utils.swap_tensors``); a tensor held elsewhere
    stays a plain meta tensor."""
    import torch
    from torch import nn

    parameter, buffer = _empty_classes()
    ref = weakref.ref(owner)
    with torch_function_off():
        for t in _tensors(module):
            if not t.is_meta or type(t) in (parameter, buffer):
                continue
            cls = parameter if isinstance(t, nn.Parameter) else buffer
            # empty_strided, not empty_like: from meta to meta that takes ~1 ms a tensor
            # (a Python reference implementation), this ~10 us.
            with torch.inference_mode(t.is_inference()):  # is_inference() answers the same
                meta = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
                twin = as_subclass(cls, meta, t.requires_grad)
            twin.__dict__.update(t.__dict__)
            twin.__dict__[_OWNER_KEY] = ref
            with contextlib.suppress(RuntimeError):  # held elsewhere (a weakref, a view)
                torch.utils.swap_tensors(t, twin)


def unmark_empty(module: nn.Module) -> None:
    """Take the owner off ``module``'s empty tensors: their use no longer asks one to fill
    them, and runs on meta (a module its owner gave up)."""
    with torch_function_off():
        for t in _tensors(module):
            t.__dict__.pop(_OWNER_KEY, None)


def _tensors(module: nn.Module) -> list[Any]:
    """Each parameter and buffer of ``module`` once, tied ones included once."""
    seen: dict[int, Any] = {}
    for sub in module.modules():
        params, buffers = own_tensor_tables(sub)
        for t in (*params.values(), *buffers.values()):
            if t is not None:
                seen.setdefault(id(t), t)
    return list(seen.values())
