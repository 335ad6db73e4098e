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
(``stageload.hooks.registry``) of the placeholder, and while the component is out every
submodule carries :func:`stageload.release`'s hook, which revives it through that one, as
diffusers' group offloading hooks the parts of a model. Any method that computes
(``forward``, ``encode``, ``decode``, ``get_text_features``, ``generate``) calls some
submodule, and that call makes the component ready first: its stage is entered and it
loads. No list of method names.

The placeholder is the component's own class and object (``type(pipe.unet)`` is what
eager gives: ``from_pipe``, ``torch.compile`` and ``copy`` see the real class). What no
submodule call catches, in one place:

- ``.device``: a model answers its first tensor's device, ``meta`` while the weights are
  out, and pipelines move inputs there. The empty tensors answer where it runs instead
  (:attr:`StageHook.run_device`), as diffusers' group offloading answers its
  ``onload_device``;
- conversions (``to``, ``half``, ``cuda``, ...): all go through ``nn.Module._apply``, which
  fails on ``meta`` for a device change and must be remembered for the next load
  (``pipe.to("cuda")`` while the VAE is out): :func:`intercept` patches it on the object;
- reads of its weights' values without computing with the module (peft's ``fuse_lora``
  reads ``base_layer.weight.data``, textual inversion copies the token embedding, a user
  edits ``pipe.unet.conv_out.weight.data.mul_(1.5)``): while the component is out, its
  tensors are meta tensors of a class whose torch functions load it first
  (:mod:`stageload.hooks.empty`), metadata reads (``shape``, ``dtype``, ``device``)
  excepted;
- the component's own parameters and buffers (not its submodules'): no forward reaches
  them (LTX-Video reads ``vae.latents_mean`` before decoding), so they stay resident,
  read from the checkpoint when the placeholder is built (:func:`keep_own`).

Reading an attribute never loads anything.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.events import NOTE, Event
from ..errors import StageloadError
from ..external import (
    CONVERT_METHOD,
    HF_HOOK_ATTR,
    torch_function_off,
)
from ..hooks.empty import mark_empty
from ..hooks.registry import HookRegistry, ModuleHook, patch
from ..hooks.release import held_outside, unmark_released
from ..load import changes
from ..load.refill import conversion_probes, fresh_memory
from ..load.skeleton import build_empty, fill_from
from ..load.weights import like, named_tensors

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


class StagedChangeError(StageloadError, RuntimeError):
    """A change to a staged component that cannot be kept; the message says the way out."""


class StageHook(ModuleHook):
    """A staged component's hook: in the placeholder's hook registry, and at its
    ``_hf_hook``, where diffusers reads accelerate's hook
    protocol (``pre_forward`` before ``encode``/``decode``, ``execution_device``).

    ``use()`` enters the component's stage and loads it; ``move(device, dtype)`` records a
    conversion for every later load.
    """

    no_grad = False  # accelerate's ModelHook field
    #: A copy of the component (``copy.deepcopy``, pickling) is the user's own: loaded
    #: first (:meth:`before_copy`), not staged.
    copied = False

    def __init__(
        self,
        name: str,
        use: Callable[[], None],
        move: Callable[..., None],
        device: torch.device,
        tracked: Tracked,
        load: Callable[[], None],
    ) -> None:
        import torch

        self.name = name
        # Staging runs eagerly under torch.compile: dynamo breaks the graph at these calls
        # instead of tracing into the loading (and a compiled forward then sees the loaded
        # weights, the same tensor objects at each load).
        self.use = torch.compiler.disable(use)
        self.load = torch.compiler.disable(load)
        self.move = move
        self.tracked = tracked
        self.execution_device = device
        self.stager: Callable[[], Any] | None = None  # a weakref to the StagedPipeline
        self._held_said = False  # a note that tensors held outside stay, said once
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

    def retain(self, module: nn.Module) -> list[torch.Tensor]:
        """What the checkpoint cannot give back (:meth:`Tracked.retain`), and the tensors
        something outside the component still holds (a ``state_dict()`` the script keeps
        and edits, a view): released, the holder's edits would go to memory the component
        no longer reads, and its next load the checkpoint's values (helper-56)."""
        kept = self.tracked.retain(module)
        with torch_function_off():
            held = held_outside(named_tensors(module), {id(t) for t in kept})
        if held and not self._held_said:
            self._held_said = True
            state = self.stager() if self.stager is not None else None
            if state is not None:
                state.emit(
                    Event(
                        NOTE,
                        model=self.name,
                        note=f"{self.name}: {held[0][0]} and {len(held) - 1} more tensors are "
                        f"held outside the component (a state_dict() or a view the script "
                        f"keeps, or an output's autograd graph: run under torch.no_grad()): "
                        f"they stay in memory while it is released",
                    )
                )
        return kept + [t for _, t in held]

    def released(self, module: nn.Module) -> None:
        mark_empty(module, self)

    def __reduce__(self) -> tuple[Any, ...]:
        # Copied (copy.deepcopy) or pickled (torch.save) through the component's
        # ``_hf_hook`` and its load_state_dict pre-hook: the copy gets an inert hook (the
        # thread-local state could not be copied anyway).
        return _Copied, ()

    def fill_on_use(self) -> None:
        """An empty tensor of the component was used (:mod:`stageload.hooks.empty`)."""
        if not self.passthrough:
            self.load()

    @property
    def run_device(self) -> torch.device:
        """What the component's empty tensors answer for ``.device``: where it runs, as
        ``pipe.unet.device`` answers (``x.to(next(pipe.unet.parameters()).device)`` put
        the inputs on ``meta``)."""
        return self.execution_device

    def before_state_dict(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        """``load_state_dict`` into the component (peft's LoRA loading does): the change
        needs the weights, so load them now, in the current stage, and give the tensors
        added since (a LoRA's, created on ``meta`` beside the empty weights) memory to be
        copied into. torch's own ``load_state_dict`` pre-hook calls this."""
        import torch

        if self.passthrough:
            return
        self.tracked.receiving = True  # the state dict gives the added tensors their values
        try:
            self.load()
        finally:
            self.tracked.receiving = False
        for _, t in named_tensors(module):
            if t.is_meta:
                empty = torch.empty_like(t, device=self.execution_device)
                torch.utils.swap_tensors(t, like(t, empty))

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


class _Copied:
    """What a copy of a staged component holds where the original holds its
    :class:`StageHook` (``_hf_hook``, the load_state_dict pre-hook): accelerate's
    protocol, passing everything through, claiming no device (diffusers then reads the
    device from the weights, as for a component without a hook)."""

    no_grad = False
    execution_device = None
    passthrough = True  # StageHook.before_state_dict, bound to this, does nothing

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module

    def before_state_dict(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        return None


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


# -- what a hook cannot catch: read without computing, or a conversion -------------------------
def intercept(skeleton: nn.Module, hook: StageHook) -> None:
    """Patch conversions (``nn.Module._apply``) on this one object: no submodule call
    catches them (see the module docstring)."""

    def convert(inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)
        def _apply(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if hook.passthrough:
                return inner(fn, *args, **kwargs)
            # pipe.to("cuda", torch.float16) reaches every component: learn where ``fn``
            # sends a tensor like the weights and record that for every later load (the
            # weights convert now if they are in; on meta only a dtype can change).
            where = conversion(skeleton, fn, hook.execution_device)
            if where is None:  # more than a move (a memory format): ``fn`` at each load
                hook.move(None, None, fn)
            elif where[0] is None and where[1] is not None and _stays_on_meta(fn):
                # a dtype alone (.half(), .float(), .to(dtype)): made at each load by ``fn``
                # itself, which .half() and .to(float16) write differently for a complex
                # tensor. Not one that names a device (.to("cpu", dtype) on a CPU pipeline):
                # the placeholder on meta cannot take it, and .to()'s dtype rule is real_to's.
                hook.move(None, where[1], None, fn)
            elif where[0] is not None or where[1] is not None:
                hook.move(*where)
            elif fresh_memory(fn, _weight_dtypes(skeleton), hook.execution_device):
                # .to("cpu:0") copies a CPU tensor (cpu:0 is not cpu): eager's weights sit
                # in fresh memory from now on, aligned otherwise than a reload's.
                hook.move(None, None, fresh_copy)
            return skeleton

        return _apply

    patch(skeleton, CONVERT_METHOD, convert)


def conversion(
    skeleton: nn.Module, fn: Callable[..., Any], device: torch.device
) -> tuple[Any, Any] | None:
    """Where ``fn`` (a conversion ``_apply`` was given) sends the weights: (the device, or
    None if it stays; the dtype, or None if none changes), or None where it does more (a
    memory format). Probed with each dtype the weights have: a bfloat16 Wan transformer's
    first parameter is a table kept in float32, which ``.to(float32)`` leaves as it is."""

    probes = conversion_probes(fn, _weight_dtypes(skeleton), device)
    if probes is None:
        return None
    first = next(iter(probes.values()))
    moved = first.device if first.device != device else None
    return moved, next((p.dtype for was, p in probes.items() if p.dtype != was), None)


def _stays_on_meta(fn: Callable[..., Any]) -> bool:
    """Whether the conversion ``fn`` leaves a tensor on its device (``.half()``'s,
    ``.to(dtype)``'s), as a placeholder's weights on ``meta`` must stay: ``.to("cpu",
    dtype)``'s copies out of meta, which fails."""
    import torch

    try:
        return bool(fn(torch.empty(1, device="meta")).is_meta)
    except Exception:  # noqa: BLE001  a conversion that takes no meta tensor
        return False


def _weight_dtypes(skeleton: nn.Module) -> set[Any]:
    """The floating dtypes of the component's parameters (the default one if none)."""
    import torch

    dtypes = {p.dtype for p in skeleton.parameters() if p.is_floating_point()}
    return dtypes or {torch.get_default_dtype()}


def fresh_copy(tensor: Any) -> Any:
    """A conversion that copies each tensor into fresh memory (what ``.to("cpu:0")`` does
    to a CPU tensor), replayed after each load: one entry however often it is made."""
    return tensor.clone()


def real_apply(module: nn.Module, fn: Callable[[Any], Any]) -> nn.Module:
    """``fn`` (a conversion ``_apply`` was given) on the component's weights, past the
    stager's conversion patch."""
    with passthrough(module):
        return module._apply(fn)


def real_to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """``.to()`` on the component's weights, past the stager's conversion patch: torch's
    own, a replay of a conversion the user's ``.to()`` made (whose library checks and
    warnings ran then: diffusers' "should be kept in float32" came again at each load)."""
    from torch import nn

    with passthrough(module):
        return nn.Module.to(module, *args, **kwargs)


# -- building ------------------------------------------------------------------------------------
def build_skeleton(cls: type, folder: Path, dtype: torch.dtype) -> nn.Module:
    """An instance of ``cls`` itself built from the config in ``folder``, with every
    parameter on ``meta`` in ``dtype`` (float32 where the class keeps modules in float32)."""
    return build_empty(cls, folder, dtype)


def attach(skeleton: nn.Module, hook: StageHook) -> None:
    """Put ``hook`` on ``skeleton``, and where diffusers looks for it.

    The parts need no stage hook of their own: while the component is out, each carries
    :func:`stageload.release`'s hook, which revives it through this one (so a method
    that computes, ``encode`` or ``get_text_features``, loads it); once it is in, its
    parts run as eager's do, with no hook in their calls (a hook on each of a UNet's ~500
    submodule calls cost 18 % of a tiny pipeline's call, everything loaded).
    """
    HookRegistry.attach(skeleton).add(STAGE, hook)
    setattr(skeleton, HF_HOOK_ATTR, hook)
    skeleton.register_load_state_dict_pre_hook(hook.before_state_dict)
    intercept(skeleton, hook)


def own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``module`` itself, not of its submodules: no submodule call reaches
    them, so a placeholder keeps them resident."""
    return [
        *module.named_parameters(recurse=False, remove_duplicate=False),
        *module.named_buffers(recurse=False, remove_duplicate=False),
    ]


def keep_own(skeleton: nn.Module, built: dict[str, torch.Tensor], files: list[Path] | str) -> None:
    """Give the released ``skeleton``'s own tensors their values again: the checkpoint's
    (``files``), else what the constructor gave them (``built``: non-persistent buffers).
    A tensor with neither stays empty, and a read of it sees ``meta``."""
    import torch

    own = own_tensors(skeleton)
    if not own:
        return
    saved: dict[str, torch.Tensor] = {}
    if not isinstance(files, str):
        from safetensors import safe_open

        wanted = {name for name, _ in own}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in wanted & set(f.keys()):
                    saved[key] = f.get_tensor(key)
    with torch.no_grad():
        for name, t in own:
            value = saved.get(name, built.get(name))
            if value is None or not t.is_meta:
                continue
            value = value.to(dtype=t.dtype) if value.is_floating_point() else value
            torch.utils.swap_tensors(t, like(t, value.clone()))


# -- what the checkpoint holds, and what a user changed -----------------------------------------
@dataclass
class _Mark:
    """A tensor as it was filled from the checkpoint."""

    ptr: int
    version: int | None  # None for an inference tensor, which counts no versions
    shape: tuple[int, ...]
    dtype: torch.dtype
    sample: torch.Tensor | None


class Tracked:
    """Which tensors of a placeholder its checkpoint holds, and which a user has changed.

    A staged component stays what the user made it (issue: LoRA silently dropped): adapter
    weights, new embedding rows, replaced submodules and weights changed in place are not
    in the checkpoint, so a release leaves them in memory (:meth:`retain`) and a load fills
    only the rest. The placeholder's tensor objects live as long as it does (releases and
    loads swap their contents), so the tensor that was ``to_q.weight`` when the placeholder
    was built is found again after peft moved it to ``to_q.base_layer.weight``.

    A checkpoint tensor counts as changed once what it holds differs from when it was
    filled: its address, shape, dtype, version counter or a sample of its values
    (:mod:`stageload.load.changes`, the check auto's session makes too).
    """

    def __init__(self, skeleton: nn.Module) -> None:
        # Keyed by id, holding the tensor so the id cannot be reused.
        self._origin = {id(t): (t, name) for name, t in named_tensors(skeleton)}
        # A checkpoint tensor's name when the placeholder was built -> its checkpoint key:
        # a conversion (nn.Module._apply) gives a buffer a new object under the same name.
        self._by_name = {name: name for name, _ in named_tensors(skeleton)}
        self._marks: dict[int, _Mark] = {}
        self.receiving = False  # a load_state_dict is about to fill what was added

    def key(self, name: str, t: torch.Tensor) -> str | None:
        """The checkpoint key of ``t`` (at ``name`` in the placeholder), or None for a
        tensor the checkpoint does not hold (an adapter's)."""
        hit = self._origin.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        key = self._by_name.get(name)
        if key is not None:  # a new object where a checkpoint tensor was: that tensor
            self._origin[id(t)] = (t, key)
        return key

    def names(self, module: nn.Module, *, unchanged: bool = False) -> dict[str, str]:
        """Name in ``module`` -> checkpoint key, for its checkpoint tensors (only those
        unchanged since filled, with ``unchanged``)."""
        out: dict[str, str] = {}
        for name, t in named_tensors(module):
            key = self.key(name, t)
            if key is not None and not (unchanged and self.changed(t)):
                out[name] = key
        return out

    def changed(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (in memory) differs from what its last fill gave it."""
        if t.is_meta:
            return False
        mark = self._marks.get(id(t))
        if mark is None:
            return True
        return (
            mark.ptr != t.data_ptr()
            or (mark.version is not None and mark.version != changes.version(t))
            or mark.shape != tuple(t.shape)
            or mark.dtype != t.dtype
            or not changes.same(mark.sample, changes.sample(t))
        )

    def added_empty(self, module: nn.Module) -> list[str]:
        """Names of tensors added to ``module`` while it was empty that still have no values
        (code that builds tensors on ``meta`` itself, not where the component runs)."""
        return [n for n, t in named_tensors(module) if t.is_meta and self.key(n, t) is None]

    def empty(self, module: nn.Module) -> set[str]:
        """The names of ``module``'s empty tensors: what a fill is about to fill."""
        return {name for name, t in named_tensors(module) if t.is_meta}

    def filled(self, module: nn.Module, fresh: set[str]) -> None:
        """Record the tensors named in ``fresh`` as a fill (or a conversion the stager
        applies to every load) just left them: the baseline a change is seen against."""
        for name, t in named_tensors(module):
            if name in fresh and not t.is_meta and self.key(name, t) is not None:
                self._marks[id(t)] = _Mark(
                    t.data_ptr(), changes.version(t), tuple(t.shape), t.dtype, changes.sample(t)
                )

    def retain(self, module: nn.Module) -> list[torch.Tensor]:
        """The tensors a release must leave in memory: those the checkpoint cannot give back,
        and those holding a gradient (a release between two backward passes of one
        optimizer step dropped the first's, silently: full fine-tuning with gradient
        accumulation, before its first step)."""
        kept: dict[int, torch.Tensor] = {}
        for name, t in named_tensors(module):
            if t.is_meta or id(t) in kept:
                continue
            if self.key(name, t) is None or self.changed(t) or t.grad is not None:
                kept[id(t)] = t
        return list(kept.values())


# -- filling -------------------------------------------------------------------------------------
def fill(skeleton: nn.Module, loaded: nn.Module, tracked: Tracked) -> nn.Module:
    """Give the empty tensors of ``skeleton`` the contents of ``loaded`` (a
    ``from_pretrained`` model of the same class, :func:`stageload.load.skeleton.fill_from`),
    keeping every module and tensor object of the skeleton, the hooks on them, and what the
    user added or changed (``tracked``). Returns ``skeleton``; ``loaded`` is spent."""
    base = type(skeleton)
    if not isinstance(loaded, base):
        raise TypeError(
            f"loaded a {type(loaded).__qualname__} for a {base.__qualname__} placeholder; the "
            f"checkpoint's class changed since the pipeline was built"
        )
    fresh = tracked.empty(skeleton)
    frozen = _frozen(skeleton)  # the loaded tensors come with their own flag

    def missing(name: str) -> TypeError:
        return TypeError(
            f"the loaded {base.__qualname__} has no tensor for {name!r} of its placeholder; "
            f"the checkpoint's config changed since the pipeline was built"
        )

    with passthrough(skeleton):
        fill_from(
            skeleton,
            loaded,
            missing=missing,
            names=tracked.names(skeleton),
            skip=lambda name, t: tracked.key(name, t) is None,  # added while empty: check_added
        )
        for sub in skeleton.modules():
            unmark_released(sub)  # live again
        for name, t in skeleton.named_parameters():
            if name in frozen:
                t.requires_grad_(False)
    tracked.filled(skeleton, fresh)
    return skeleton


def _frozen(skeleton: nn.Module) -> set[str]:
    """The empty parameters the script took gradients from while the component was not
    loaded (``unet.requires_grad_(False)``, the first line of a training script)."""
    return {n for n, t in skeleton.named_parameters() if t.is_meta and not t.requires_grad}


def check_added(name: str, skeleton: nn.Module, tracked: Tracked) -> None:
    """After a fill: refuse tensors added to the component while it was not loaded that
    still have no values (nothing gives a tensor made on ``meta`` its values)."""
    added = tracked.added_empty(skeleton)
    if added and not tracked.receiving:
        shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        raise StagedChangeError(
            f"{len(added)} tensors were added to {name!r} while it was not loaded ({shown}), "
            f"so they never got values. Load the component first, then add them: "
            f"pipe.stageload.load({name!r})"
        )


def check_merges(name: str, skeleton: nn.Module) -> None:
    """Refuse to fill a component into which an adapter was merged while it was empty.

    peft's ``merge`` (``fuse_lora``) adds each adapter's delta to the base weight in
    place. On an unloaded component that weight is on ``meta``: the sum goes nowhere, the
    layer still counts as merged, and a fill from the checkpoint would silently give the
    base model. peft layers say what they merged in ``merged_adapters``.
    """
    for sub_name, sub in skeleton.named_modules():
        base = getattr(sub, "base_layer", None)
        weight = getattr(base, "weight", None)
        if getattr(sub, "merged_adapters", None) and getattr(weight, "is_meta", False):
            raise StagedChangeError(
                f"adapters {list(sub.merged_adapters)} were fused into {name}.{sub_name} while "
                f"{name!r} was not loaded, so the fused weights were never computed; unfuse "
                f"(pipe.unfuse_lora()), load the component first "
                f"(pipe.stageload.load({name!r})), then fuse again"
            )
