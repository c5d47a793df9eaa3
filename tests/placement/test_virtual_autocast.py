"""`torch.autocast` on the strict virtual accelerators behaves as on CUDA: the ops CUDA autocasts run in the
autocast dtype, CUDA's float32 ops in float32, a float32 autocast is disabled with CUDA's warning (Mochi's RoPE
opens one on its tensors' device type), and every op CUDA has an autocast kernel for has a policy here.

Numbers compare bit for bit: the virtual device runs the same CPU kernel on the same cast operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from placement.devices import torch_device
from placement.virtual_autocast import POLICY_OPS


@pytest.fixture(autouse=True)
def strict_virtual_gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "1")


def test_every_op_cuda_autocasts_has_a_policy_on_the_virtual_device():
    cuda = {name.removeprefix("aten::") for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")}
    assert set(POLICY_OPS) == cuda


def test_an_autocast_region_on_a_virtual_gpu_casts_as_cuda_does():
    gpu = torch_device(0)
    torch.manual_seed(0)
    linear, x = nn.Linear(8, 4), torch.randn(3, 8)
    placed = nn.Linear(8, 4).to(gpu)
    placed.load_state_dict(linear.state_dict())
    with torch.autocast(gpu.type, dtype=torch.bfloat16):
        out = placed(x.to(gpu))
        assert out.dtype is torch.bfloat16 and out.device == gpu  # lower precision: linear, matmul
        assert (out @ out.T).dtype is torch.bfloat16
        assert torch.softmax(out, -1).dtype is torch.float32  # float32 unless a dtype is named
        assert torch.softmax(out, -1, dtype=torch.bfloat16).dtype is torch.bfloat16
        assert F.layer_norm(out, (4,)).dtype is torch.float32 and torch.exp(out).dtype is torch.float32
        assert torch.addcmul(out.float(), out, out).dtype is torch.float32  # promoted to the widest
        assert (out + out).dtype is torch.bfloat16  # an op without a policy falls through
        with torch.autocast(gpu.type, enabled=False):
            assert (out.float() @ out.float().T).dtype is torch.float32
    expected = F.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16())
    assert torch.equal(out.cpu(), expected)
    assert placed(x.to(gpu)).dtype is torch.float32  # outside the region: as before


def test_a_float32_autocast_is_disabled_with_a_warning_as_on_cuda():
    """Mochi's `with torch.autocast(freqs.device.type, torch.float32)`: CUDA warns and runs unchanged."""
    gpu = torch_device(1)
    x = torch.randn(2, 2).to(gpu)
    with pytest.warns(UserWarning, match="Disabling autocast"):
        with torch.autocast(gpu.type, torch.float32):
            product = x @ x
    assert product.dtype is torch.float32 and torch.equal(product.cpu(), x.cpu() @ x.cpu())


def test_binary_cross_entropy_is_refused_under_autocast_as_on_cuda():
    gpu = torch_device(0)
    x = torch.rand(4).to(gpu)
    with torch.autocast(gpu.type, dtype=torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(x, x)


class RotaryInFloat32(nn.Module):
    """Opens an autocast region on its input's device type, as Mochi's RoPE does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast(x.device.type, torch.float32):
            return self.proj(x).cos()


def test_an_autocast_region_on_meta_is_estimated_and_torch_autocast_comes_back():
    """Call capture runs the model on meta, which torch has no autocast for ("unsupported autocast device_type
    'meta'" refused Mochi's every call= plan): the region runs uncast, the same bytes as without it."""
    from placement.activations.estimate import estimate_activations

    plain = torch.autocast
    with torch.device("meta"):
        model = RotaryInFloat32()
    x = torch.empty(4, 16, 8, device="meta")
    peak = estimate_activations(model, (x,))
    assert peak >= 2 * x.numel() * x.element_size()  # the projection and its cosine, in float32
    assert torch.autocast is plain and torch.amp.autocast is plain
    with pytest.raises(RuntimeError, match="unsupported autocast device_type 'meta'"):
        model(x)  # outside an estimate, torch's own answer
