"""Layerwise casting on the CPU: fp8/bf16 storage, fp32 compute.

Exactness: the technique must equal the plain model whose cast weights were rounded to the storage dtype
once (atol 1e-5). Against the original full-precision model the error is bounded by the storage dtype's
precision: float8_e4m3fn keeps 3 mantissa bits (relative rounding error <= 2**-4 per weight), so the
relative output error of this 3-layer model must stay below 10%; bfloat16 (8 bits, <= 2**-9) below 1%.
"""

import pytest
import torch
from accelerate.hooks import remove_hook_from_module
from torch import nn

from hooks import (
    GroupOffloadingConfig,
    OffloadConfigError,
    OffloadConflictError,
    apply_group_offloading,
    apply_layerwise_casting,
    remove_group_offloading,
    remove_layerwise_casting,
)
from same_output import assert_same_output


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.nn.functional.gelu(block(x))
        x = self.conv(self.norm(x).transpose(1, 2)).transpose(1, 2)
        return self.head(x)


TOKENS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
CAST = ["blocks.0", "blocks.1", "conv", "head"]


def make():
    torch.manual_seed(0)
    return Tiny().eval()


def rounded_copy(model, names, storage_dtype):
    """The plain model with the weights of `names` rounded to `storage_dtype` once: the exact reference."""
    reference = make()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name in names:
            for param in reference.get_submodule(name).parameters():
                param.copy_(param.to(storage_dtype).to(param.dtype))
    return reference


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("storage_dtype, bound", [(torch.float8_e4m3fn, 0.10), (torch.bfloat16, 0.01)])
def test_outputs_match_rounded_weights_exactly_and_the_original_within_the_dtype_bound(storage_dtype, bound):
    model = make()
    with torch.no_grad():
        original = model(TOKENS)
        exact = rounded_copy(model, CAST, storage_dtype)(TOKENS)
    apply_layerwise_casting(model, storage_dtype=storage_dtype, compute_dtype=torch.float32)
    with torch.no_grad():
        for _ in range(2):
            out = model(TOKENS)
            assert_same_output(out, exact)
            assert 0 < relative_error(out, original) < bound
            # Between calls the cast layers hold the storage dtype; norms and embeddings were never touched.
            assert {model.get_submodule(n).weight.dtype for n in CAST} == {storage_dtype}
            assert model.embed.weight.dtype == model.norm.weight.dtype == torch.float32
    remove_layerwise_casting(model)
    assert [n for n, m in model.named_modules() if hasattr(m, "_hf_hook")] == []
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        assert_same_output(model(TOKENS), exact)  # the rounding stays


def test_skip_patterns_and_classes():
    model = make()
    apply_layerwise_casting(model, compute_dtype=torch.float32, skip_modules_pattern=[r"^blocks\.0$", "head"])
    cast = {n for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    assert cast == {"blocks.1", "conv"}
    everything = make()
    apply_layerwise_casting(everything, compute_dtype=torch.float32, skip_modules_pattern=(), skip_modules_classes=())
    assert everything.embed.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        assert_same_output(everything(TOKENS), rounded_copy(make(), ["embed", *CAST], torch.float8_e4m3fn)(TOKENS))


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("to_disk", [False, True], ids=["ram", "disk"])
def test_casting_then_group_offloading(offload_type, to_disk, tmp_path):
    model = make()
    with torch.no_grad():
        exact = rounded_copy(model, CAST, torch.float8_e4m3fn)(TOKENS)
    apply_layerwise_casting(model, compute_dtype=torch.float32)
    apply_group_offloading(
        model,
        GroupOffloadingConfig(onload_device="cpu", offload_type=offload_type,
                              offload_to_disk_path=tmp_path if to_disk else None),
    )
    with torch.no_grad():
        for _ in range(2):
            assert_same_output(model(TOKENS), exact)
            assert model.head.weight.dtype == torch.float8_e4m3fn
            assert model.head.weight.device.type == ("meta" if to_disk else "cpu")
    with pytest.raises(OffloadConflictError, match="apply layerwise casting first"):
        apply_layerwise_casting(model, compute_dtype=torch.float32)
    remove_group_offloading(model)
    assert model.head.weight.dtype == torch.float8_e4m3fn and model.head.weight.device.type == "cpu"
    remove_hook_from_module(model, recurse=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_casting_with_model_offload_and_refused_with_sequential_offload():
    from hooks import apply_model_cpu_offload, apply_sequential_cpu_offload, remove_sequential_cpu_offload

    model = make()
    with torch.no_grad():
        exact = rounded_copy(model, CAST, torch.float8_e4m3fn)(TOKENS)
    apply_layerwise_casting(model, compute_dtype=torch.float32)
    chain = apply_model_cpu_offload([model])
    with torch.no_grad():
        assert_same_output(model(TOKENS), exact)
    assert model.head.weight.dtype == torch.float8_e4m3fn
    chain.remove()
    with pytest.raises(OffloadConflictError, match="group offloading with offload_type='leaf_level'"):
        apply_sequential_cpu_offload(model)
    remove_layerwise_casting(model)
    apply_sequential_cpu_offload(model)
    with pytest.raises(OffloadConflictError, match="already has sequential offload.*casting would save nothing"):
        apply_layerwise_casting(model, compute_dtype=torch.float32)
    remove_sequential_cpu_offload(model)


def test_storage_dtype_this_torch_cannot_hold():
    model = make()
    with pytest.raises(OffloadConfigError, match="cannot hold weights as torch.float4_e2m1fn_x2"):
        apply_layerwise_casting(model, storage_dtype=torch.float4_e2m1fn_x2, compute_dtype=torch.float32)
    with pytest.raises(OffloadConfigError, match="has no such dtype"):
        apply_layerwise_casting(model, storage_dtype="float8_e9m9", compute_dtype=torch.float32)
    with pytest.raises(OffloadConfigError, match="must be a floating"):
        apply_layerwise_casting(model, storage_dtype=torch.int8, compute_dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert [n for n, m in model.named_modules() if hasattr(m, "_hf_hook")] == []


def test_uncast_layers_in_another_dtype_are_a_clear_error():
    with pytest.raises(OffloadConfigError, match=r"norm\.weight \(torch.float32\).*torch_dtype=torch.bfloat16"):
        apply_layerwise_casting(make())  # default compute dtype bf16; the fp32 norm cannot take bf16 inputs


def _weight_bytes(model, dtype_of):
    return sum(p.numel() * dtype_of(name).itemsize for name, p in model.named_parameters())


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("to_disk", [False, True], ids=["ram", "disk"])
def test_casting_composes_with_group_offloading_on_an_accelerator(offload_type, to_disk, tmp_path, monkeypatch):
    """Under group offloading's stores onto a (strict virtual) accelerator, the groups move the small dtype and
    the upcast happens there: each call moves the stored bytes once and brings no weight back."""
    from hooks import measure_transfers
    from placement.devices import torch_device

    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    model = make()
    with torch.no_grad():
        exact = rounded_copy(model, CAST, torch.float8_e4m3fn)(TOKENS)
    apply_layerwise_casting(model, compute_dtype=torch.float32)
    stored = _weight_bytes(model, lambda name: model.get_submodule(name.rpartition(".")[0]).weight.dtype)
    apply_group_offloading(model, GroupOffloadingConfig(onload_device=0, offload_type=offload_type,
                                                        offload_to_disk_path=tmp_path if to_disk else None))
    with torch.no_grad():
        for _ in range(2):
            with measure_transfers() as meter:
                out = model(TOKENS.to(torch_device(0)))
            assert_same_output(out.cpu(), exact)
            assert meter.weights.host_to_accelerator_bytes == stored < _weight_bytes(model, lambda _: torch.float32)
            assert meter.weights.accelerator_to_host_bytes == 0
            assert model.head.weight.dtype == torch.float8_e4m3fn
    remove_group_offloading(model)
    remove_layerwise_casting(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_an_inference_mode_call_leaves_group_offloading_possible_as_accelerates_cast_hooks_do_not():
    """Why the cast hooks are ours (module docstring): accelerate's cast the layer down again after each forward,
    so under `torch.inference_mode()` (a pipeline's `__call__`) the stored weights become inference tensors and
    group offloading applied afterwards cannot make them parameters. Ours put the stored tensor back."""
    from accelerate.hooks import LayerwiseCastingHook, add_hook_to_module

    theirs = make()
    for name in CAST:
        add_hook_to_module(theirs.get_submodule(name), LayerwiseCastingHook(torch.float8_e4m3fn, torch.float32,
                                                                            non_blocking=False), append=True)
    with torch.inference_mode():
        theirs(TOKENS)
    assert theirs.head.weight.is_inference()
    with pytest.raises(RuntimeError, match="inference tensor"):
        apply_group_offloading(theirs, GroupOffloadingConfig(onload_device="cpu"))

    ours = make()
    with torch.no_grad():
        exact = rounded_copy(ours, CAST, torch.float8_e4m3fn)(TOKENS)
    apply_layerwise_casting(ours, compute_dtype=torch.float32)
    with torch.inference_mode():
        ours(TOKENS)
    assert not ours.head.weight.is_inference() and ours.head.weight.dtype == torch.float8_e4m3fn
    apply_group_offloading(ours, GroupOffloadingConfig(onload_device="cpu"))
    with torch.no_grad():
        assert_same_output(ours(TOKENS), exact)
