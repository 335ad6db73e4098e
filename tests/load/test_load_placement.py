"""Every path that fills a module from a checkpoint puts each CPU tensor at the address
alignment (mod 64) that its reference loader gives it (stageload.load.placement).

The direct checks compare ``data_ptr() % 64`` of every tensor with the reference's, so
they hold or fail on any CPU. The paths: ``load_weights`` (reference: ``load_state_dict``
into a module built on the CPU, or safetensors' ``load_file`` with ``placement=MAPPED``),
``streamed`` blocks at their forward (the same two), the diffusers adapter's refills
and streamed components (``from_pretrained``), the Pixal3D adapter's refills and streamed
flow models (the port's ``from_pretrained``, a ``load_state_dict``). Each check runs a
second time with the rule shifted by 16 bytes and must then fail: the controls.

The output check (a streamed SD UNet equal to ``from_pretrained``'s, bit for bit) is in
tests/diffusers/test_diffusers_stream.py; its control here streams with every tensor 64-byte aligned
(the code before the rule) and sees the output differ where the CPU's kernels round
differently for differently aligned inputs (a 2-core AMD EPYC with AVX-512: 2e-7).
Elsewhere that control skips, saying so; the direct checks still hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402

from stageload import from_safetensors, load_weights, streamed  # noqa: E402
from stageload.load import placement  # noqa: E402
from stageload.load.placement import MAPPED, Placement, misalignment  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# -- helpers -------------------------------------------------------------------------------
def residues(module: nn.Module) -> dict[str, int]:
    """Each CPU tensor of ``module`` (parameters and buffers): its address mod 64."""
    return {
        k: misalignment(t)
        for k, t in itertools.chain(module.named_parameters(), module.named_buffers())
        if not t.is_meta and t.device.type == "cpu"
    }


def differences(got: dict[str, int], want: dict[str, int]) -> list[str]:
    """Tensors placed unlike the reference, or missing on one side."""
    return sorted(
        f"{k}: {got.get(k)} != {want.get(k)}"
        for k in want.keys() | got.keys()
        if got.get(k) != want.get(k)
    )


def teeth(want: dict[str, int]) -> None:
    """The reference has tensors off a 64-byte boundary: a check that could not tell an
    aligned load from the reference's would prove nothing."""
    assert any(want.values()), "every reference tensor 64-byte aligned: no test"


@contextmanager
def at_forward() -> Iterator[dict[nn.Module, dict[str, int]]]:
    """While the block runs: each module called, with its own loaded tensors' residues as
    they were while it ran (a streamed block's weights are freed right after)."""
    seen: dict[nn.Module, dict[str, int]] = {}

    def probe(module: nn.Module, *_: Any) -> None:
        own = itertools.chain(
            module.named_parameters(recurse=False), module.named_buffers(recurse=False)
        )
        got = seen.setdefault(module, {})
        for key, t in own:
            if not t.is_meta and t.device.type == "cpu":
                got.setdefault(key, misalignment(t))

    hooks = [
        nn.modules.module.register_module_forward_pre_hook(probe),
        nn.modules.module.register_module_forward_hook(probe),
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def named(model: nn.Module, seen: dict[nn.Module, dict[str, int]], under: str) -> dict[str, int]:
    """The residues ``at_forward`` saw, by name in ``model``, for the tensors below ``under``."""
    out: dict[str, int] = {}
    for prefix, sub in model.named_modules():
        for key, r in seen.get(sub, {}).items():
            name = f"{prefix}.{key}" if prefix else key
            if name.startswith(under):
                out[name] = r
    return out


@pytest.fixture(params=["rule", "control"])
def rule(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each direct check twice: with the rule, and (the control) with every placement
    shifted by 16 bytes, which each check must notice."""
    if request.param == "control":
        real = Placement.misalign

        def shifted(self: Placement, *args: Any) -> int:
            return (real(self, *args) + 16) % placement.ALIGN

        monkeypatch.setattr(Placement, "misalign", shifted)
    return request.param


def verdict(rule: str, problems: list[str]) -> None:
    if rule == "rule":
        assert problems == []
    else:
        assert problems, "the control placed every tensor as the reference: the check is blind"


# -- load_weights and streamed -------------------------------------------------------------
class Odd(nn.Module):
    """Tensors of 20, 28 and 60 bytes between larger ones: file offsets off 64 bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(5), nn.Linear(5, 5)) for _ in "xyz")
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        for block in self.blocks:
            h = h + block(h)
        return self.b(h)


@pytest.fixture(scope="module", params=[torch.float32, torch.float16])
def odd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("odd") / "odd.safetensors"
    save_file({k: v.to(request.param) for k, v in Odd().state_dict().items()}, str(path))
    return path


def load_file_residues(path: Path) -> dict[str, int]:
    """Where safetensors' ``load_file`` puts each tensor (in the file's mmap)."""
    return {k: misalignment(t) for k, t in load_file(str(path)).items()}


def load_state_dict_residues(path: Path) -> dict[str, int]:
    """Where ``load_state_dict(load_file(...))`` into a module built on the CPU puts them."""
    state = load_file(str(path))
    reference = Odd().to(state["a.weight"].dtype)
    reference.load_state_dict(state)
    return residues(reference)


def test_mapped_places_each_tensor_as_load_file(odd: Path, rule: str) -> None:
    want = load_file_residues(odd)
    teeth(want)
    with torch.device("meta"):
        module = Odd().to(load_file(str(odd))["a.weight"].dtype)
    load_weights(module, odd, placement=MAPPED)
    verdict(rule, differences(residues(module), want))


def test_a_converting_load_places_as_a_converted_load_file(odd: Path, rule: str) -> None:
    # from_pretrained(torch_dtype=) converts with .to(): fresh tensors, 64-byte aligned.
    want = {k: misalignment(t.to(torch.bfloat16)) for k, t in load_file(str(odd)).items()}
    module = from_safetensors(Odd, odd, dtype=torch.bfloat16, placement=MAPPED)()
    verdict(rule, differences(residues(module), want))


def test_by_default_load_weights_places_as_load_state_dict(odd: Path, rule: str) -> None:
    dtype = load_file(str(odd))["a.weight"].dtype
    module = from_safetensors(lambda: Odd().to(dtype), odd)()
    verdict(rule, differences(residues(module), load_state_dict_residues(odd)))


@pytest.mark.parametrize("how", ["default", "mapped"])
def test_streamed_blocks_sit_where_their_reference_puts_them(
    odd: Path, rule: str, how: str
) -> None:
    """Reference: ``from_safetensors`` (default, as ``load_state_dict``) or ``load_file``
    (``placement=MAPPED``), for every block's tensors at its forward and the rest."""
    dtype = load_file(str(odd))["a.weight"].dtype
    if how == "mapped":
        model = streamed(lambda: Odd().to(dtype), odd, blocks="blocks", placement=MAPPED)
        want = load_file_residues(odd)
        teeth({k: v for k, v in want.items() if k.startswith("blocks.")})
    else:
        model = streamed(lambda: Odd().to(dtype), odd, blocks="blocks")
        want = load_state_dict_residues(odd)
    with at_forward() as seen, torch.no_grad():
        model(torch.ones(2, 7, dtype=dtype))
    got = named(model, seen, "blocks.") | residues(model)  # the blocks, and the rest
    verdict(rule, differences(got, want))


# -- the diffusers adapter -----------------------------------------------------------------
def _diffusers() -> tuple[Any, Any, Any]:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import diffusers

    from stageload.diffusers import staged_pipeline
    from stageload.testing.families import FAMILIES, folder

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    return staged_pipeline, FAMILIES, folder


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, families, folder = _diffusers()
    return folder(families["sd"], tmp_path_factory.mktemp("sd"))


def refill_problems(sd: Path) -> tuple[list[str], Any]:
    """Each component of a staged SD pipeline loaded (from_pretrained itself), evicted,
    and refilled; where the refill's tensors sit otherwise than from_pretrained's, and the
    reference pipeline."""
    staged_pipeline, families, _ = _diffusers()
    fam = families["sd"]
    reference = fam.load(sd)
    pipe = staged_pipeline(fam.cls, sd, keep=())
    models = pipe.stageload.models
    problems: list[str] = []
    for name in models:
        models[name]  # the first load: from_pretrained itself
        models.evict(name)
        again = models[name]  # a refill from the files
        want = residues(getattr(reference, name))
        problems += [f"{name}.{p}" for p in differences(residues(again), want)]
    return problems, reference


def test_diffusers_refills_place_as_from_pretrained(
    sd: Path, rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read, not mapped: a refill maps what from_pretrained had mapped (as the file lies,
    whatever the rule), which would leave the control nothing to shift."""
    from stageload.load import refill

    monkeypatch.setattr(refill, "_map", lambda *args, **kwargs: None)
    problems, reference = refill_problems(sd)
    teeth(residues(reference.unet))
    verdict(rule, problems)


def test_diffusers_refills_mapped_from_the_files_place_as_from_pretrained(sd: Path) -> None:
    """As shipped: what from_pretrained had mapped, a refill maps again (the same file
    offsets from a page boundary), the rest is read and placed."""
    assert refill_problems(sd)[0] == []


def test_a_diffusers_streamed_component_places_as_from_pretrained(sd: Path, rule: str) -> None:
    staged_pipeline, families, _ = _diffusers()
    fam = families["sd"]
    want = residues(fam.load(sd).unet)
    pipe = staged_pipeline(fam.cls, sd, keep=(), stream=["unet"])
    with at_forward() as seen:
        pipe(**fam.call(0))
    unet = pipe.unet
    got = named(unet, seen, "") | residues(unet)
    # Every tensor of the UNet was seen in memory (a block's, at its forward).
    assert got.keys() == want.keys()
    verdict(rule, differences(got, want))


def _stream_unet(sd: Path, monkeypatch: pytest.MonkeyPatch | None) -> Any:
    staged_pipeline, families, _ = _diffusers()
    fam = families["sd"]
    if monkeypatch is not None:  # the code before the rule: every block 64-byte aligned
        monkeypatch.setattr(Placement, "misalign", lambda self, *a: 0)
    pipe = staged_pipeline(fam.cls, sd, keep=(), stream=["unet"])
    return pipe(**fam.call(0))[0]


def test_control_streamed_blocks_aligned_otherwise_change_the_output_here(
    sd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reference: ``from_pretrained`` (the same pipeline eager), torch on one thread."""
    _, families, _ = _diffusers()
    fam = families["sd"]
    expected = fam.load(sd)(**fam.call(0))[0]
    assert torch.equal(_stream_unet(sd, None), expected)  # with the rule
    broken = _stream_unet(sd, monkeypatch)
    if torch.equal(broken, expected):
        pytest.skip(
            "this CPU's kernels round alike at any alignment: the output control cannot "
            "fail here (the direct checks above still compare every address)"
        )
    assert not torch.equal(broken, expected)


# -- the Pixal3D adapter -------------------------------------------------------------------
SS = "sparse_structure_flow_model"


def _port_model(stub: Path, name: str, port: Any) -> nn.Module:
    (found,) = sorted(stub.rglob(f"{name}.safetensors"))
    return port.models.from_pretrained(str(found.with_suffix("")))


def test_pixal3d_streams_and_refills_place_as_the_port(
    stub: Path, image: Path, tmp_path: Path, rule: str
) -> None:
    pytest.importorskip("PIL.Image")
    from fixtures.pixal3d_stub import port_args
    from stageload import ListSink
    from stageload.pixal3d import Pixal3DRun, import_port

    port = import_port(stub)
    sink = ListSink()
    args = port_args(port, image, tmp_path / "o.glb")
    with Pixal3DRun(port, args, stream=[SS], events=sink) as staged, at_forward() as seen:
        staged.execute()
        stream = staged._streams[SS]  # the streamed model's latest stream (as test_pixal3d_stream)
        decoder = staged.models["shape_slat_decoder"]  # loaded before: refilled in place
        refilled = residues(decoder)
    assert "shape_slat_decoder" in [e.model for e in sink.kinds("reload")]
    # The port fills its models with load_state_dict: every tensor 64-byte aligned.
    want = residues(_port_model(stub, SS, port))
    problems = [f"{SS}.{p}" for p in differences(named(stream.model, seen, ""), want)]
    want = residues(_port_model(stub, "shape_slat_decoder", port))
    problems += [f"decoder.{p}" for p in differences(refilled, want)]
    verdict(rule, problems)
