"""The class of a placeholder: the component's real class, under the same name and module,
with every way of using the model routed through the stager first.

Calling the module, calling a method that runs it (``encode``, ``get_text_features``,
``generate``) and reading one of its own parameters or buffers (LTX-Video reads
``vae.latents_mean`` before decoding) make the component ready: its stage is entered and it
loads. ``.to()``, ``.half()``, ``.float()``, ``.bfloat16()``, ``.double()``, ``.type()``,
``.cpu()`` and ``.cuda()`` are recorded and applied to every later load. ``.device``
answers the execution device while the weights are on ``meta``. Methods that diffusers
models run outside ``forward`` already call ``self._hf_hook.pre_forward(self)``, the hook
protocol of accelerate's offloading; :class:`StageHook` answers it the same way.
"""

from __future__ import annotations

import builtins
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..release import _RELEASED_ATTR as _RELEASED

if TYPE_CHECKING:
    import torch
    from torch import nn

#: Instance attribute holding the callable that makes a component ready before a use.
USE_ATTR = "_stageload_use"
#: Instance attribute holding the device a component runs on, answered while on meta.
DEVICE_ATTR = "_stageload_device"
#: Instance attribute holding the callable that takes ``.to(device, dtype)`` for the stager.
MOVE_ATTR = "_stageload_move"


@functools.cache
def _module_type() -> type:
    from torch import nn

    return nn.Module


class StagingRemovedError(RuntimeError):
    """Something tried to take a staged component's stageload hook off (diffusers'
    ``remove_all_hooks``, which its offloading methods call first)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"{name!r} is loaded per stage by stageload, and diffusers' remove_all_hooks() "
            f"(called by enable_model_cpu_offload, enable_sequential_cpu_offload and "
            f"reset_device_map) would remove that and leave it empty; a staged pipeline "
            f"already keeps only the current stage's models in memory, so drop the offload "
            f"call, or load the pipeline with from_pretrained to use diffusers' offloading"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name,))


class StageHook:
    """The part of accelerate's ``ModelHook`` protocol that diffusers reads.

    ``pre_forward`` runs before ``encode``/``decode`` (diffusers' ``apply_forward_hook``);
    ``execution_device`` is where ``pipe._execution_device`` puts latents and embeddings.
    """

    no_grad = False

    def __init__(
        self, use: Callable[[], None], execution_device: torch.device, name: str = "?"
    ) -> None:
        self.use = use
        self.execution_device = execution_device
        self.name = name

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.use()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        # accelerate's remove_hook_from_module calls this; diffusers calls that from
        # remove_all_hooks (enable_model_cpu_offload, enable_sequential_cpu_offload,
        # reset_device_map). Without this hook the component would stay an empty
        # placeholder that nothing loads, so refuse before anything is removed.
        raise StagingRemovedError(self.name)

    def __repr__(self) -> str:
        return f"StageHook(execution_device={self.execution_device!r})"


# Methods of these libraries' base classes change or describe the structure
# (``enable_tiling``, ``set_attn_processor``, ``save_pretrained``); calling one on a
# placeholder must not load it. ``generate`` is the exception: it runs the model.
_FRAMEWORK_MODULES = (
    "torch.",
    "diffusers.configuration_utils",
    "diffusers.models.modeling_utils",
    "diffusers.models.attention",
    "diffusers.models.cache_utils",
    "diffusers.loaders",
    "diffusers.hooks",
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.integrations",
    "transformers.utils",
    "huggingface_hub",
    "accelerate",
    "peft",
)
_RUNS_THE_MODEL = frozenset({"generate"})
# Public methods of a model class itself that still only touch settings or structure.
_STRUCTURAL_PREFIXES = (
    "enable_",
    "disable_",
    "set_",
    "register_",
    "fuse_",
    "unfuse_",
    "load_",
    "unload_",
    "save_",
    "from_",
    "tie_",
    "init_",
    "post_init",
    "get_input_embeddings",
    "get_output_embeddings",
    "get_decoder",
    "get_encoder",
    "get_submodule",
    "can_generate",
)
# dtype conversions of nn.Module: each is ``.to(dtype)`` and must persist across loads.
_CASTS = {"half": "float16", "float": "float32", "bfloat16": "bfloat16", "double": "float64"}


def running_methods(base: type) -> list[str]:
    """Public methods of ``base`` that run the model (``encode``, ``get_text_features``,
    ``generate``): a call on a placeholder must load it first. ``forward`` is left out:
    ``__call__`` already makes the model ready."""
    names: dict[str, None] = {}
    for klass in base.__mro__:
        if klass is object:
            continue
        framework = (klass.__module__ or "").startswith(_FRAMEWORK_MODULES)
        for name, value in vars(klass).items():
            if name.startswith("_") or name == "forward" or name in _CASTS:
                continue
            if not inspect.isfunction(value):  # properties, classmethods, staticmethods
                continue
            if framework and name not in _RUNS_THE_MODEL:
                continue
            if name.startswith(_STRUCTURAL_PREFIXES):
                continue
            names.setdefault(name, None)
    return list(names)


def _ready(self: Any) -> None:
    use = self.__dict__.get(USE_ATTR)
    if use is not None:
        use()


def _running(cls_ref: list[type], name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        _ready(self)
        return getattr(super(cls_ref[0], self), name)(*args, **kwargs)

    return method


def _cast(cls_ref: list[type], name: str, dtype_name: str) -> Callable[..., Any]:
    original = getattr(_module_type(), name)

    @functools.wraps(original)
    def cast(self: Any, *args: Any, **kwargs: Any) -> Any:
        move = self.__dict__.get(MOVE_ATTR)
        if move is None:
            return getattr(super(cls_ref[0], self), name)(*args, **kwargs)
        import torch

        move(None, getattr(torch, dtype_name))
        return self

    return cast


@functools.cache
def staged_class(base: type) -> type:
    """A subclass of ``base`` under the same name whose calls go through the stager first."""
    ref: list[type] = []  # the class, once made, for super() in the generated methods

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        _ready(self)
        return super(cls, self).__call__(*args, **kwargs)

    def __getattr__(self: Any, name: str) -> Any:
        # Parameters and buffers live in _parameters/_buffers, so nn.Module.__getattr__
        # answers them. On an empty placeholder they are on meta: reading one (LTX-Video
        # reads vae.latents_mean before decoding) loads the component first.
        value = super(cls, self).__getattr__(name)
        d = self.__dict__
        if (
            getattr(value, "is_meta", False)
            and _RELEASED in d
            and USE_ATTR in d
            and (name in d["_parameters"] or name in d["_buffers"])
        ):
            d[USE_ATTR]()
            value = super(cls, self).__getattr__(name)
        return value

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        # pipe.to("cuda", torch.float16) reaches every component: the stager records the
        # target, moves the model if it is loaded, and applies it to every later load.
        move = self.__dict__.get(MOVE_ATTR)
        if move is None:
            return super(cls, self).to(*args, **kwargs)
        import torch

        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        move(device, dtype)
        return self

    def type(self: Any, dst_type: Any) -> Any:
        move = self.__dict__.get(MOVE_ATTR)
        if move is None:
            return super(cls, self).type(dst_type)
        move(None, dst_type)
        return self

    def cpu(self: Any) -> Any:
        return self.to("cpu")

    def cuda(self: Any, device: Any = None) -> Any:
        import torch

        where = torch.device("cuda", device) if isinstance(device, int) else device
        return self.to(where or "cuda")

    base_device = getattr(base, "device", None)

    def device(self: Any) -> torch.device:
        first = next(self.parameters(), None)
        if (first is None or first.is_meta) and DEVICE_ATTR in self.__dict__:
            return self.__dict__[DEVICE_ATTR]
        if isinstance(base_device, property) and base_device.fget is not None:
            return base_device.fget(self)
        import torch

        return first.device if first is not None else torch.device("cpu")

    namespace: dict[str, Any] = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "__call__": __call__,
        "__getattr__": __getattr__,
        "to": to,
        "type": type,
        "cpu": cpu,
        "cuda": cuda,
        "device": property(device, doc="Where the model runs, also while it is not loaded."),
        "_stageload_base": base,
    }
    for name in running_methods(base):
        namespace[name] = _running(ref, name, getattr(base, name))
    for name, dtype_name in _CASTS.items():
        namespace[name] = _cast(ref, name, dtype_name)
    cls = builtins.type(base.__name__, (base,), namespace)
    ref.append(cls)
    return cls
