"""The activation estimate of a tiled or sliced VAE call (`pipelines.hf.calls.vae_techniques`): each class's own
tiled code on fake tensors, its decoder replayed by input shape, equals the estimate of the full tiled run on
every VAE class the families use (diffusers' and ours), and leaves the module as it found it."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights

from pipelines.hf.calls.capture import ExampleCall
from pipelines.hf.calls.vae_techniques import WithTechniques, supported_techniques, tile_description
from placement.plan_schema import MemoryTechnique

diffusers = pytest.importorskip("diffusers")

TILING, SLICING = MemoryTechnique.VAE_TILING, MemoryTechnique.VAE_SLICING


def _kl():
    return diffusers.AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                                   sample_size=16)


def _hunyuan():
    vae = diffusers.AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8, 8), latent_channels=4, norm_num_groups=4,
                                              layers_per_block=1)
    vae.tile_sample_min_height = vae.tile_sample_min_width = 64
    vae.tile_sample_stride_height = vae.tile_sample_stride_width = 48
    return vae


def _wan():
    vae = diffusers.AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
    vae.tile_sample_min_height = vae.tile_sample_min_width = 64
    vae.tile_sample_stride_height = vae.tile_sample_stride_width = 48
    return vae


def _cogvideox():
    vae = diffusers.AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, norm_num_groups=2,
                                           layers_per_block=1, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                           up_block_types=("CogVideoXUpBlock3D",) * 4)
    vae.tile_sample_min_height = vae.tile_sample_min_width = 64
    vae.tile_overlap_factor_height = vae.tile_overlap_factor_width = 0.25
    vae.tile_latent_min_height = vae.tile_latent_min_width = 8
    return vae


def _ours():
    from pipelines.text_to_image.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig

    return AutoencoderKL(AutoencoderKLConfig(block_out_channels=[8, 8], layers_per_block=1, norm_num_groups=4,
                                             tile_sample_size=16, tile_overlap_factor=0.5))


VAES = {  # (build, latent shape: two tiles or more along each tiled axis, and a batch of 2 where it slices)
    "AutoencoderKL": (_kl, (2, 4, 20, 24)),
    "AutoencoderKLHunyuanVideo": (_hunyuan, (1, 4, 5, 12, 10)),
    "AutoencoderKLWan": (_wan, (1, 4, 2, 12, 10)),
    "AutoencoderKLCogVideoX": (_cogvideox, (1, 4, 3, 12, 10)),
    "ours": (_ours, (2, 4, 20, 24)),
}


@pytest.fixture(scope="module", params=list(VAES))
def vae_and_latents(request):
    build, shape = VAES[request.param]
    with init_empty_weights():
        vae = build().eval()
    return vae, torch.empty(shape, device="meta")


def test_the_replayed_estimate_equals_the_full_tiled_run(vae_and_latents):
    vae, latents = vae_and_latents
    call = ExampleCall(args=(latents,), method="decode")
    techniques = {TILING, SLICING} if latents.shape[0] > 1 else {TILING}
    replayed = WithTechniques(call=call, techniques=frozenset(techniques)).estimate(vae)
    for technique in techniques:  # the full run: the flags set by hand, every tile decoded on fake tensors
        setattr(vae, "use_tiling" if technique is TILING else "use_slicing", True)
    try:
        full = call.estimate(vae)
    finally:
        vae.use_tiling = vae.use_slicing = False
    assert replayed == full
    assert replayed < call.estimate(vae)  # and tiling is worth it at this size


def test_the_module_is_left_as_it_was(vae_and_latents):
    vae, latents = vae_and_latents
    forward, flags = vae.decoder.forward, (vae.use_tiling, vae.use_slicing)
    WithTechniques(call=ExampleCall(args=(latents,), method="decode"),
                   techniques=frozenset({TILING, SLICING})).estimate(vae)
    assert (vae.use_tiling, vae.use_slicing) == flags and "forward" not in vae.decoder.__dict__
    assert vae.decoder.forward == forward and "blend_v" not in vae.__dict__


def test_what_each_vae_offers_and_its_tiles(vae_and_latents):
    vae, _ = vae_and_latents
    assert set(supported_techniques(vae)) == {TILING, SLICING}
    assert tile_description(vae).startswith("tiles of ")
    assert supported_techniques(torch.nn.Linear(2, 2)) == ()
