"""estimate_call: the peak, and the call's return value with every tensor a plain meta tensor laid out alike."""

from typing import NamedTuple

import pytest
import torch
from accelerate import init_empty_weights
from torch import nn

import placement
from placement.activations import CallEstimate, estimate_activations, estimate_call


class Pair(NamedTuple):
    hidden: torch.Tensor
    pooled: torch.Tensor


class Outputs(nn.Module):
    """Returns a namedtuple, a dict, a transposed view, a plain number and an object holding tensors."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 6)

    def forward(self, x):
        hidden = self.linear(x)
        first, second = hidden.chunk(2, dim=-1)
        return Pair(hidden=hidden, pooled=hidden.mean(1)), {"t": hidden.transpose(1, 2), "n": 3}, \
            Halves(first, second)


class Halves:
    def __init__(self, first, second):
        self.first, self.second, self.label = first, second, "halves"


def assert_meta_like(meta: torch.Tensor, shape, dtype, stride=None):
    assert type(meta) is torch.Tensor and meta.device.type == "meta"
    assert tuple(meta.shape) == tuple(shape) and meta.dtype == dtype
    if stride is not None:
        assert meta.stride() == tuple(stride)


def test_the_output_keeps_its_structure_with_plain_meta_tensors():
    module = Outputs()
    result = estimate_call(module, (torch.empty(2, 5, 8),), dtype=torch.bfloat16)
    assert isinstance(result, CallEstimate) and result.peak_bytes == estimate_activations(
        module, (torch.empty(2, 5, 8),), dtype=torch.bfloat16)
    pair, named, halves = result.output
    assert isinstance(pair, Pair)
    assert_meta_like(pair.hidden, (2, 5, 6), torch.bfloat16, (30, 6, 1))
    assert_meta_like(pair.pooled, (2, 6), torch.bfloat16)
    assert set(named) == {"t", "n"} and named["n"] == 3
    assert_meta_like(named["t"], (2, 6, 5), torch.bfloat16, (30, 1, 6))  # the transposed view's strides
    # Tensors that shared a storage share one again, at the same offsets.
    assert named["t"].untyped_storage() is pair.hidden.untyped_storage()
    assert type(halves) is Halves and halves.label == "halves"
    assert_meta_like(halves.second, (2, 5, 3), torch.bfloat16, (30, 6, 1))
    assert halves.second.storage_offset() == 3 and halves.second.untyped_storage() is pair.hidden.untyped_storage()


def test_the_output_feeds_another_estimate_outside_the_fake_mode():
    first, second = nn.Linear(8, 16), nn.Linear(16, 4)
    hidden = estimate_call(first, (torch.empty(3, 8),)).output
    out = estimate_call(second, (hidden,))
    assert_meta_like(out.output, (3, 4), torch.float32)
    assert out.peak_bytes == 3 * 16 * 4 + 3 * 4 * 4  # its input and its output, float32


def test_it_is_exported_from_placement():
    assert placement.estimate_call is estimate_call and placement.CallEstimate is CallEstimate
    with pytest.raises(TypeError):
        CallEstimate(1, None)  # keyword-only
    estimate = CallEstimate(peak_bytes=1, output=None)
    with pytest.raises(AttributeError):
        estimate.peak_bytes = 2  # frozen


def test_diffusers_outputs_keep_their_types():
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    config = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                  norm_num_groups=8)
    with init_empty_weights():
        vae = diffusers.AutoencoderKL(**config)
    encoded = estimate_call(vae, (torch.empty(1, 3, 32, 32, device="meta"),), method="encode").output
    assert type(encoded).__name__ == "AutoencoderKLOutput"
    distribution = encoded.latent_dist
    assert isinstance(distribution, DiagonalGaussianDistribution)
    assert_meta_like(distribution.parameters, (1, 8, 16, 16), torch.float32)
    assert_meta_like(distribution.mean, (1, 4, 16, 16), torch.float32)
    assert distribution.mean.untyped_storage() is distribution.parameters.untyped_storage()
    decoded = estimate_call(vae, (distribution.mean,), method="decode").output
    assert type(decoded).__name__ == "DecoderOutput"
    assert_meta_like(decoded.sample, (1, 3, 32, 32), torch.float32)


def test_transformers_outputs_keep_their_types():
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPTextConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=16)
    with init_empty_weights():
        clip = transformers.CLIPTextModel(config)
    output = estimate_call(clip, (torch.zeros(2, 7, dtype=torch.long, device="meta"),), dtype=torch.float16).output
    assert type(output).__name__ == "BaseModelOutputWithPooling"
    assert_meta_like(output.last_hidden_state, (2, 7, 16), torch.float16)
    assert_meta_like(output[1], (2, 16), torch.float16)
