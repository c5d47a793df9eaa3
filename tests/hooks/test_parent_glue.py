"""A split component's own forward, between its entries, meets tensors from several GPUs (the parent glue of
hooks/input_moving.py):
what it combines is moved to one device, while ops inside entries stay strict; the glue leaves nothing behind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hooks import measure_transfers
from hooks.dispatch import dispatch, undispatch
from hooks.input_moving import glue_of
from placement.devices import torch_device

from resident_weights import place_resident_weights
from same_output import assert_same_output


class Residuals(nn.Module):
    """SD3-with-ControlNet's shape: a residual made before the blocks is added after each, in the parent's code;
    and a U-Net's: the parent concatenates the last block's output with the first's."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        residual = self.embed(x)
        h, first = x, None
        for block in self.blocks:
            h = block(h) + residual  # the residual stays on the execution device
            first = h if first is None else first
        return self.head(torch.cat([h, first], dim=-1))


SPLIT = {"embed": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "head": 1}


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    torch.manual_seed(0)
    reference = Residuals().eval()
    model = Residuals().eval()
    model.load_state_dict(reference.state_dict())
    dispatch(place_resident_weights(model, SPLIT), SPLIT, execution_device=0)
    return model, reference


def test_what_the_parent_combines_is_moved_to_one_device_and_counted(split):
    model, reference = split
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = reference(x)
        with measure_transfers() as meter:
            out = model(x.to(torch_device(0)))
    assert out.device == torch_device(0)  # back where the input came from
    assert_same_output(out, expected)
    # 2 x 4 floats (32 bytes) each: the hidden state to GPU 1 at blocks.1 (its entry hook), the residual to GPU 1
    # after blocks.1 and after blocks.2 and the first block's output to GPU 1 at the cat (the glue), the output
    # back to GPU 0 (the top hook): nothing else.
    assert meter.inputs.accelerator_to_accelerator_bytes == 5 * 32


def test_a_mix_up_inside_an_entry_still_raises(split):
    model, _ = split
    model.blocks[2].weight.data = model.blocks[2].weight.data.to(torch_device(0))  # a placement bug
    with pytest.raises(RuntimeError, match="at least two devices, (vgpu:1 and vgpu:0|vgpu:0 and vgpu:1)"), torch.no_grad():
        model(torch.randn(2, 4, device=torch_device(0)))
    assert torch._C._len_torch_function_stack() == 0  # the mode left with the failed forward


def test_undispatch_takes_the_glue_off(split):
    model, reference = split
    assert glue_of(model) is not None
    undispatch(model)
    assert glue_of(model) is None
    assert not any(block._forward_pre_hooks or block._forward_hooks for block in model.blocks)
    model.to("cpu")
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert_same_output(model(x), reference(x))


def test_a_module_on_one_device_gets_no_glue(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    model = Residuals().eval()
    whole = {key: 1 for key in SPLIT}
    dispatch(place_resident_weights(model, whole), whole, execution_device=1)
    assert glue_of(model) is None
