"""Model offload (chained `cpu_offload_with_hook`) and sequential offload (`cpu_offload`) on the CPU.

Without an accelerator both execute on the CPU: the hooks run, outputs must equal the plain run, sequential
offload must leave `meta` placeholders between calls, and removal must leave plain modules. Moves between
devices are checked on a GPU (marked tests).
"""

from types import SimpleNamespace

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, CpuOffload, attach_align_device_hook
from torch import nn

from hooks import (
    GroupOffloadingConfig,
    OffloadConfigError,
    OffloadConflictError,
    apply_group_offloading,
    apply_model_cpu_offload,
    apply_sequential_cpu_offload,
    remove_group_offloading,
    remove_model_cpu_offload,
    remove_sequential_cpu_offload,
    resolve_execution_device,
)
from hooks.hook_utils import hooks_of
from hooks.model_offload import ComponentEntryHook, ModelOffloadHook
from same_output import assert_same_output


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x):
        return self.proj(x)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.norm(x)


class Decoder(nn.Module):
    """Entered through `decode`, like a VAE: its own forward is never called by the pipeline."""

    def __init__(self):
        super().__init__()
        self.post = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def decode(self, x):
        return self.out(torch.relu(self.post(x)))


def make():
    torch.manual_seed(0)
    return Encoder().eval(), Denoiser().eval(), Decoder().eval()


def run(encoder, denoiser, decoder, steps=3):
    x = encoder(torch.linspace(-1, 1, 12).reshape(2, 6))
    for _ in range(steps):
        x = denoiser(x)
    return decoder.decode(x)


def hooked(*modules):
    return [name for module in modules for name, sub in module.named_modules() if hasattr(sub, "_hf_hook")]


def test_model_offload_chain_ring_outputs_twice_and_removal():
    parts = make()
    standalone = nn.Linear(2, 2)
    with torch.no_grad():
        expected = run(*parts)
    chain = apply_model_cpu_offload(parts, standalone=[standalone])
    assert chain.execution_device == resolve_execution_device(None)
    encoder, denoiser, decoder = (hook.hook for hook in chain.chained)
    # Graph order: each component sends its predecessor back; the first one closes the ring.
    assert denoiser.prev_module_hook is chain.chained[0] and decoder.prev_module_hook is chain.chained[1]
    assert encoder.prev_module_hook is chain.chained[2]
    assert chain.standalone[0].hook.prev_module_hook is None
    assert all(isinstance(hooks_of(child)[0], ComponentEntryHook) for child in parts[2].children())
    with torch.no_grad():
        for _ in range(2):
            assert_same_output(run(*parts), expected)
            chain.offload_all()
            assert {p.device.type for part in parts for p in part.parameters()} == {"cpu"}
    # Enabling twice replaces the hooks rather than stacking them.
    chain = apply_model_cpu_offload(parts, standalone=[standalone])
    assert [type(h) for h in hooks_of(parts[1])] == [ModelOffloadHook]  # accelerate's CpuOffload, place-aware
    assert isinstance(hooks_of(parts[1])[0], CpuOffload)
    chain.remove()
    assert hooked(*parts, standalone) == []
    with torch.no_grad():
        assert_same_output(run(*parts), expected)


def test_entering_a_component_through_a_method_runs_its_offload_hook_once():
    """`decode` never calls forward: the first child to run must bring the whole component over."""
    decoder = make()[2]
    weights = {name: tensor.clone() for name, tensor in decoder.state_dict().items()}
    decoder.to("meta")  # "not on the execution device yet"
    calls = []

    def bring_over(component):
        calls.append(component)
        component.to_empty(device="cpu").load_state_dict(weights)
        hook.onloaded = True

    hook = SimpleNamespace(execution_device=torch.device("cpu"), place="cpu", onloaded=False, onload=bring_over)
    offload = SimpleNamespace(hook=hook)
    for child in decoder.children():
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(child, ComponentEntryHook(component=decoder, offload=offload))
    with torch.no_grad():
        out = decoder.decode(torch.ones(1, 8))
    assert calls == [decoder] and out.device.type == "cpu"


def test_sequential_offload_keeps_weights_off_the_module_between_calls():
    parts = make()
    with torch.no_grad():
        expected = run(*parts)
    for part in parts:
        handle = apply_sequential_cpu_offload(part)
        assert handle.config.execution_device == "cpu" and handle.technique.value == "sequential offload"
    with torch.no_grad():
        for _ in range(2):
            assert_same_output(run(*parts), expected)
            assert {p.device.type for part in parts for p in part.parameters()} == {"meta"}
    apply_sequential_cpu_offload(parts[1])  # again: replaced, not stacked
    with torch.no_grad():
        assert_same_output(run(*parts), expected)
    for part in parts:
        remove_sequential_cpu_offload(part)
    assert hooked(*parts) == []
    assert {p.device.type for part in parts for p in part.parameters()} == {"cpu"}
    with torch.no_grad():
        assert_same_output(run(*parts), expected)


def test_mixing_techniques_is_a_clear_error():
    encoder, denoiser, _ = make()
    apply_model_cpu_offload([encoder])
    with pytest.raises(OffloadConflictError, match=r"already has model offload.*remove_model_cpu_offload"):
        apply_group_offloading(encoder, GroupOffloadingConfig(onload_device="cpu"))
    with pytest.raises(OffloadConflictError, match="already has model offload"):
        apply_sequential_cpu_offload(encoder)
    remove_model_cpu_offload(encoder)

    apply_group_offloading(denoiser, GroupOffloadingConfig(onload_device="cpu"))
    with pytest.raises(OffloadConflictError, match="already has group offloading"):
        apply_model_cpu_offload([denoiser])
    with pytest.raises(OffloadConflictError, match="already has group offloading"):
        apply_sequential_cpu_offload(denoiser)
    remove_group_offloading(denoiser)

    apply_sequential_cpu_offload(encoder)
    with pytest.raises(OffloadConflictError, match="already has sequential offload"):
        apply_model_cpu_offload([encoder])
    remove_sequential_cpu_offload(encoder)

    attach_align_device_hook(denoiser, execution_device=torch.device("cpu"))  # what a device map installs
    assert any(isinstance(h, AlignDevicesHook) for h in hooks_of(denoiser.blocks[0]))
    with pytest.raises(OffloadConflictError, match="already has a device map.*undispatch"):
        apply_sequential_cpu_offload(denoiser)


def test_execution_device_resolution():
    assert resolve_execution_device("cpu") == torch.device("cpu")
    with pytest.raises(OffloadConfigError, match="'disk'"):
        resolve_execution_device("disk")
    if not torch.cuda.is_available():
        assert resolve_execution_device(None) == torch.device("cpu")
        with pytest.raises(OffloadConfigError, match="needs CUDA"):
            apply_model_cpu_offload([nn.Linear(2, 2)], execution_device=0)


@pytest.mark.gpu
def test_model_offload_moves_one_component_at_a_time_on_gpu():
    parts = make()
    with torch.no_grad():
        expected = run(*parts)
    chain = apply_model_cpu_offload(parts, execution_device=0)

    def where():
        return [next(part.parameters()).device.type for part in parts]

    with torch.no_grad():
        x = parts[0](torch.linspace(-1, 1, 12).reshape(2, 6))
        assert where() == ["cuda", "cpu", "cpu"]
        x = parts[1](x)
        assert where() == ["cpu", "cuda", "cpu"]
        out = parts[2].decode(x)
        assert where() == ["cpu", "cpu", "cuda"]
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-4)
        parts[0](torch.zeros(2, 6))  # the next call: the ring sends the decoder back
        assert where() == ["cuda", "cpu", "cpu"]
    chain.offload_all()
    assert where() == ["cpu", "cpu", "cpu"]


@pytest.mark.gpu
def test_sequential_offload_executes_on_gpu():
    parts = make()
    with torch.no_grad():
        expected = run(*parts)
    for part in parts:
        apply_sequential_cpu_offload(part, execution_device=0)
    with torch.no_grad():
        out = run(*parts)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-4)
