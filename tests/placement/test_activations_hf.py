"""estimate_activations on modules the project did not write: tiny transformers and diffusers models."""

import pytest
import torch
from accelerate import init_empty_weights

from placement.activations.estimate import measure_activations
from placement.activations.estimate import estimate_activations

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")


def clip_text_model():
    config = transformers.CLIPTextConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    )
    config._attn_implementation = "sdpa"
    return transformers.CLIPTextModel(config).eval()


def unet_config():
    return dict(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    )


def vae_config():
    return dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4, norm_num_groups=8,
    )


def within_ten_percent(estimate, measured):
    return measured > 0 and abs(estimate - measured) <= 0.10 * measured


@pytest.fixture(scope="module")
def clip():
    torch.manual_seed(0)
    return clip_text_model()


@pytest.fixture(scope="module")
def unet():
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(**unet_config()).eval()


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(**vae_config()).eval()


@pytest.mark.parametrize("length", [16, 77])
def test_transformers_clip_text_model(clip, length):
    input_ids = torch.randint(0, 1000, (2, length))
    assert within_ten_percent(estimate_activations(clip, (input_ids,)), measure_activations(clip, (input_ids,)))


@pytest.mark.parametrize("side", [8, 24])
def test_diffusers_unet(unet, side):
    args = (torch.randn(2, 4, side, side), torch.tensor(10), torch.randn(2, 8, 32))
    assert within_ten_percent(estimate_activations(unet, args), measure_activations(unet, args))


@pytest.mark.parametrize("side", [8, 32])
def test_diffusers_vae_decode(vae, side):
    latents = torch.randn(1, 4, side, side)
    estimate = estimate_activations(vae, (latents,), method="decode")
    assert within_ten_percent(estimate, measure_activations(vae, (latents,), method="decode"))


def test_diffusers_models_on_meta_match_the_real_ones(unet, vae):
    with init_empty_weights():
        unet_on_meta = diffusers.UNet2DConditionModel(**unet_config())
        vae_on_meta = diffusers.AutoencoderKL(**vae_config())
    meta_args = (torch.empty(2, 4, 32, 32, device="meta"), torch.tensor(10), torch.empty(2, 8, 32, device="meta"))
    real_args = (torch.randn(2, 4, 32, 32), torch.tensor(10), torch.randn(2, 8, 32))
    assert estimate_activations(unet_on_meta, meta_args) == estimate_activations(unet, real_args)
    latents = torch.empty(1, 4, 32, 32, device="meta")
    assert estimate_activations(vae_on_meta, (latents,), method="decode") == estimate_activations(
        vae, (torch.randn(1, 4, 32, 32),), method="decode"
    )


def test_vae_decode_grows_with_the_square_of_the_side(vae):
    small = estimate_activations(vae, (torch.empty(1, 4, 32, 32, device="meta"),), method="decode")
    large = estimate_activations(vae, (torch.empty(1, 4, 64, 64, device="meta"),), method="decode")
    assert 3.9 <= large / small <= 4.1
