"""One module object per staged component, for the pipeline's whole life: the placeholder.

The pipeline's attribute (``pipe.transformer``) is an instance of the component's real
class, built from the checkpoint's config with its parameters on ``meta``: it answers
``.config``, ``.dtype`` and every structural attribute without loading. Loading fills that
same object in place (:func:`fill` from a ``from_pretrained`` model, or
``stageload.load.refill`` straight from the files); releasing empties it again. Because
the object never changes, whatever the pipeline attached to it survives: Qwen-Image
registers a forward hook on a text-encoder submodule, and that hook must fire on the real
weights.

How a use is caught: one :class:`StageHook` sits in the hook registry
(``stageload.hooks.registry``) of every submodule of the placeholder, as diffusers' group
offloading hooks the parts of a model. Any method that computes (``forward``, ``encode``,
``decode``, ``get_text_features``, ``generate``) calls some submodule, and that call makes
the component ready first: its stage is entered and it loads. No list of method names.

What hooks cannot answer, and why the placeholder's class is a subclass of the real one
(:func:`placeholder_class`), in one place:

- ``.device``: the real class answers its first parameter's device, ``meta`` while the
  weights are out, and pipelines move inputs there (``image.to(self.vae.device)``);
- conversions (``to``, ``half``, ``cuda``, ...): all go through ``nn.Module._apply`` with an
  opaque function, which fails on ``meta`` for a device change and must be remembered for
  the next load (``pipe.to("cuda")`` while the VAE is out);
- reading a parameter or buffer of an empty placeholder (LTX-Video reads
  ``vae.latents_mean`` before decoding): attribute reads run no forward, so it loads there.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._external import (
    HF_HOOK_ATTR,
    keep_in_fp32_modules,
    non_persistent_buffers,
    transformers_from_config,
    version_at_least,
)
from ..errors import StageloadError
from ..hooks.registry import HookRegistry, ModuleHook
from ..hooks.release import is_released, unmark_released
from ..load.checkpoint import DTYPES, read_header

if TYPE_CHECKING:
    import torch
    from torch import nn

#: The registry name of the hook on every submodule of a placeholder.
STAGE = "stage"


class StagingRemovedError(StageloadError, RuntimeError):
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


class StageHook(ModuleHook):
    """A staged component's hook: in the registry of each of its submodules, and at
    ``_hf_hook`` on the placeholder itself, where diffusers reads accelerate's hook
    protocol (``pre_forward`` before ``encode``/``decode``, ``execution_device``).

    ``use()`` enters the component's stage and loads it; ``move(device, dtype)`` records a
    conversion for every later load.
    """

    no_grad = False  # accelerate's ModelHook field

    def __init__(
        self,
        name: str,
        use: Callable[[], None],
        move: Callable[[torch.device | None, torch.dtype | None], None],
        device: torch.device,
    ) -> None:
        self.name = name
        self.use = use
        self.move = move
        self.execution_device = device
        self._local = threading.local()

    @property
    def passthrough(self) -> bool:
        """True on a thread where the stager itself fills or converts the weights: its
        writes and conversions then act on the tensors, not on the stager's plan."""
        return getattr(self._local, "passthrough", False)

    @passthrough.setter
    def passthrough(self, value: bool) -> None:
        self._local.passthrough = value

    # -- stageload's protocol ---------------------------------------------------------------
    def pre_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.use()
        return None

    def revive(self, module: nn.Module) -> bool:
        self.use()
        return True

    # -- accelerate's, as diffusers reads it ------------------------------------------------
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
        # reset_device_map). The placeholder would stay empty with nothing to load it, so
        # refuse before anything is removed.
        raise StagingRemovedError(self.name)

    def __repr__(self) -> str:
        return f"StageHook({self.name!r}, execution_device={self.execution_device!r})"


def stage_hook(module: nn.Module) -> StageHook | None:
    """The placeholder's hook, or None for a module that is not a placeholder (any more)."""
    registry = HookRegistry.of(module)
    hook = registry.get(STAGE) if registry is not None else None
    return hook if isinstance(hook, StageHook) else None


@contextlib.contextmanager
def passthrough(module: nn.Module) -> Iterator[None]:
    """Conversions of ``module`` inside the block act on its weights, not the stager's plan."""
    hook = stage_hook(module)
    if hook is None:
        yield
        return
    hook.passthrough, before = True, hook.passthrough
    try:
        yield
    finally:
        hook.passthrough = before


# -- the class -----------------------------------------------------------------------------------
@functools.cache
def placeholder_class(base: type) -> type:
    """A subclass of ``base`` under the same name for what hooks cannot catch (see the
    module's docstring): ``device``, conversions, and reads of an empty tensor."""
    base_device = getattr(base, "device", None)

    def device(self: Any) -> torch.device:
        hook = stage_hook(self)
        first = next(self.parameters(), None)
        if hook is not None and (first is None or first.is_meta):
            return hook.execution_device
        if isinstance(base_device, property) and base_device.fget is not None:
            return base_device.fget(self)
        import torch

        return first.device if first is not None else torch.device("cpu")

    def _apply(self: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        hook = stage_hook(self)
        if hook is None or hook.passthrough:
            return super(cls, self)._apply(fn, *args, **kwargs)
        # pipe.to("cuda", torch.float16) reaches every component: learn where ``fn`` sends
        # a tensor like the weights, record that for every later load, and convert the
        # weights now if they are in (on meta, only a dtype can change).
        import torch

        first = next((p for p in self.parameters() if p.is_floating_point()), None)
        was = first.dtype if first is not None else torch.get_default_dtype()
        probe = fn(torch.zeros(1, dtype=was, device=hook.execution_device))
        device = probe.device if probe.device != hook.execution_device else None
        dtype = probe.dtype if probe.dtype != was else None
        if device is None and dtype is None:
            return self
        hook.move(device, dtype)
        return self

    def __getattr__(self: Any, name: str) -> Any:
        # Parameters and buffers live in nn.Module's own tables, so nn.Module.__getattr__
        # answers them: on an empty placeholder, on meta. Reading one loads it first.
        value = super(cls, self).__getattr__(name)
        if getattr(value, "is_meta", False) and is_released(self):
            hook = stage_hook(self)
            if hook is not None and not hook.passthrough:
                hook.use()
                value = super(cls, self).__getattr__(name)
        return value

    namespace: dict[str, Any] = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "device": property(device, doc="Where the model runs, also while it is not loaded."),
        "_apply": _apply,
        "__getattr__": __getattr__,
    }
    cls = type(base.__name__, (base,), namespace)
    return cls


def real_class(module: nn.Module) -> type:
    """The component's own class behind a placeholder's."""
    cls = type(module)
    return cls.__bases__[0] if cls is placeholder_class(cls.__bases__[0]) else cls


def real_to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """``.to()`` of the component's real class, on its weights, past the stager."""
    with passthrough(module):
        return real_class(module).to(module, *args, **kwargs)


# -- building ------------------------------------------------------------------------------------
def skeleton_dtype(cls: type, folder: Path, torch_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``cls.from_pretrained(folder, torch_dtype=...)`` gives the weights.

    diffusers models load as ``torch_dtype`` or else float32; transformers models as
    ``torch_dtype`` or else, from transformers 5 on, the checkpoint's own dtype.
    """
    import torch

    if torch_dtype is not None:
        return torch_dtype
    if is_transformers_model(cls) and version_at_least("transformers", "5"):
        return _checkpoint_dtype(folder) or torch.get_default_dtype()
    return torch.get_default_dtype()


def is_transformers_model(cls: type) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return issubclass(cls, PreTrainedModel)


def _checkpoint_dtype(folder: Path) -> torch.dtype | None:
    """The dtype of the first floating tensor in the folder's safetensors files (headers)."""
    import torch

    for file in sorted(folder.glob("*.safetensors")):
        for entry in read_header(file).values():
            if entry.is_floating:
                return getattr(torch, DTYPES[entry.dtype][0])
    return None


def can_stage(cls: type) -> bool:
    """Whether a placeholder can be built for ``cls`` from its saved config."""
    return is_transformers_model(cls) or (
        hasattr(cls, "load_config") and hasattr(cls, "from_config")
    )


def build_skeleton(cls: type, folder: Path, dtype: torch.dtype) -> nn.Module:
    """An instance of ``placeholder_class(cls)`` built from the config in ``folder``, with
    every parameter on ``meta`` in ``dtype`` (float32 where the class keeps modules in
    float32)."""
    import torch
    from accelerate import init_empty_weights

    if is_transformers_model(cls):
        config = cls.config_class.from_pretrained(str(folder))
        with init_empty_weights():
            model = transformers_from_config(cls, config)
    elif hasattr(cls, "load_config") and hasattr(cls, "from_config"):
        config = cls.load_config(str(folder))
        with init_empty_weights():
            model = cls.from_config(config)
    else:
        raise TypeError(
            f"cannot stage a {cls.__module__}.{cls.__qualname__}: it is neither a diffusers "
            f"ModelMixin nor a transformers PreTrainedModel; keep it loaded (leave it out of "
            f"stages=)"
        )
    keep_fp32 = keep_in_fp32_modules(cls)
    with torch.no_grad():
        for module_name, sub in model.named_modules():
            in_fp32 = any(k in module_name.split(".") for k in keep_fp32)
            for key, param in list(sub.named_parameters(recurse=False)):
                if not param.is_floating_point():
                    continue
                want = (
                    torch.float32 if in_fp32 and dtype in (torch.float16, torch.bfloat16) else dtype
                )
                meta = torch.empty_like(param, device="meta", dtype=want)
                setattr(sub, key, torch.nn.Parameter(meta, requires_grad=param.requires_grad))
    model.eval()
    model.__class__ = placeholder_class(cls)
    return model


def attach(skeleton: nn.Module, hook: StageHook) -> None:
    """Put ``hook`` on every submodule of ``skeleton``, and where diffusers looks for it."""
    for sub in skeleton.modules():
        HookRegistry.attach(sub).add(STAGE, hook)
    setattr(skeleton, HF_HOOK_ATTR, hook)


# -- filling -------------------------------------------------------------------------------------
def fill(skeleton: nn.Module, loaded: nn.Module) -> nn.Module:
    """Give ``skeleton`` the tensors of ``loaded`` (a ``from_pretrained`` model of the same
    class), keeping every module object of the skeleton and the hooks on them. Returns
    ``skeleton``; ``loaded`` is spent.

    Public torch only: ``load_state_dict(assign=True)`` takes the loaded tensors themselves
    (their dtypes, devices and memory), tied ones staying tied; the non-persistent buffers
    that ``__init__`` computes come over one by one.
    """
    import torch

    base = real_class(skeleton)
    if not isinstance(loaded, base):
        raise TypeError(
            f"loaded a {type(loaded).__qualname__} for a {base.__qualname__} placeholder; the "
            f"checkpoint's class changed since the pipeline was built"
        )
    state = loaded.state_dict(keep_vars=True)
    with passthrough(skeleton), torch.no_grad():
        result = skeleton.load_state_dict(state, strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:
            raise TypeError(
                f"the loaded {base.__qualname__} does not fit its placeholder "
                f"(missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}); "
                f"the checkpoint's config changed since the pipeline was built"
            )
        loaded_subs = dict(loaded.named_modules(remove_duplicate=False))
        for prefix, sub in skeleton.named_modules(remove_duplicate=False):
            source = loaded_subs.get(prefix)
            if source is None:
                continue
            for key in non_persistent_buffers(source):
                setattr(sub, key, getattr(source, key))
            unmark_released(sub)  # live again
    return skeleton
