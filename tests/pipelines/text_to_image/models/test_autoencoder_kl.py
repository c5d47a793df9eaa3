"""AutoencoderKL: encode/decode shapes, the posterior, slicing, tiling, and its entry points under hooks."""

from __future__ import annotations

import pytest
import torch
from accelerate import cpu_offload
from accelerate.hooks import remove_hook_from_module

from pipelines.errors import CallError
from pipelines.text_to_image.models import AutoencoderKL, DiagonalGaussian
from pipelines.text_to_image.models.autoencoder_kl import TileGrid

from reference_inputs import tiny
from same_output import assert_same_output


@pytest.fixture()
def vae():
    return tiny(AutoencoderKL)


def latents_for(vae, batch=2, height=40, width=56, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.latent_channels, height, width, generator=generator)


def test_encode_gives_a_posterior_and_decode_restores_the_image_size(vae):
    images = torch.rand(2, 3, 32, 48) * 2 - 1
    factor = vae.downsampling_factor
    with torch.no_grad():
        posterior = vae.encode(images)
        assert isinstance(posterior, DiagonalGaussian)
        assert posterior.mean.shape == (2, vae.config.latent_channels, 32 // factor, 48 // factor)
        decoded = vae.decode(posterior.mode())
    assert decoded.shape == images.shape
    assert (posterior.kl() >= 0).all()
    generator = torch.Generator().manual_seed(5)
    first = posterior.sample(generator)
    assert torch.equal(first, posterior.sample(torch.Generator().manual_seed(5)))
    assert not torch.equal(first, posterior.mode())


def test_real_presets_downsample_by_eight():
    assert AutoencoderKL.presets["sdxl"].block_out_channels == (128, 256, 512, 512)
    with torch.device("meta"):
        assert AutoencoderKL.from_config(AutoencoderKL.presets["sdxl"]).downsampling_factor == 8


def test_slicing_equals_the_plain_call(vae):
    latents, images = latents_for(vae, batch=3, height=8, width=8), torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        plain_decode, plain_encode = vae.decode(latents), vae.encode(images).mean
        vae.enable_slicing()
        sliced_decode, sliced_encode = vae.decode(latents), vae.encode(images).mean
        vae.disable_slicing()
        assert torch.equal(vae.decode(latents), plain_decode)  # slicing off again: the plain path, exactly
    assert_same_output(sliced_decode, plain_decode)
    assert_same_output(sliced_encode, plain_encode)


def test_tiling_is_skipped_when_the_input_fits_one_tile(vae):
    latents = latents_for(vae, height=16, width=16)  # tile: 32 pixels = 16 latents
    with torch.no_grad():
        plain = vae.decode(latents)
        vae.enable_tiling()
        assert torch.equal(vae.decode(latents), plain)  # one tile is not tiled: the plain path, exactly


def column_jumps(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference between neighbouring columns, one value per column boundary."""
    return (x[..., 1:] - x[..., :-1]).abs().mean(dim=(0, 1, 2))


def tile_edges(length: int, tile: int, overlap: int, factor: int) -> list[int]:
    """Output columns where a tile starts or ends."""
    grid = TileGrid.cover(length, tile, overlap)
    return sorted({factor * s for s in grid.starts[1:]} | {factor * (s + tile) for s in grid.starts[:-1]})


def test_tiled_decode_is_close_to_plain_and_seam_free(vae):
    """Tolerance: with random weights every tile normalises (GroupNorm) and attends over itself only, so a
    tiled decode differs from the plain one; its mean error stays under 35% of the image's mean magnitude
    (18% measured). Seams: the error (tiled - plain) must not jump at tile edges more than 2.5x its median
    column-to-column change (1.8x measured); stitching tiles without blending jumps 3.5x or more (4.8x
    measured) at its seams, so the check can tell a seam."""
    latents = latents_for(vae, batch=1, height=24, width=40)  # 2 x 3 tiles of 16 latents
    factor = vae.downsampling_factor
    with torch.no_grad():
        plain = vae.decode(latents)
        vae.enable_tiling()
        tiled = vae.decode(latents)
        stitched = torch.cat([vae._decode_tile(part) for part in latents.split(16, dim=-1)], dim=-1)
    assert tiled.shape == plain.shape
    assert (tiled - plain).abs().mean() < 0.35 * plain.abs().mean()

    tile, overlap = 32 // factor, int(32 // factor * 0.25)
    error_jumps = column_jumps(tiled - plain)
    at_edges = error_jumps[[edge - 1 for edge in tile_edges(40, tile, overlap, factor)]]
    assert at_edges.max() < 2.5 * error_jumps.median()
    stitched_jumps = column_jumps(stitched - plain)
    assert stitched_jumps[[31, 63]].min() > 3.5 * stitched_jumps.median()


def test_tiled_encode_has_the_plain_shape_and_is_close(vae):
    images = torch.randn(1, 3, 48, 80, generator=torch.Generator().manual_seed(1))  # 2 x 3 tiles of 32 pixels
    with torch.no_grad():
        plain = vae.encode(images).mean
        vae.enable_tiling()
        tiled = vae.encode(images).mean
    assert tiled.shape == plain.shape
    assert (tiled - plain).abs().mean() < 0.35 * plain.abs().mean()


def test_slicing_and_tiling_together(vae):
    latents = latents_for(vae, batch=2, height=24, width=24)
    with torch.no_grad():
        vae.enable_tiling()
        tiled = vae.decode(latents)
        vae.enable_slicing()
        assert_same_output(vae.decode(latents), tiled)


@pytest.mark.parametrize("size, overlap, message", [(31, 0.25, "multiple"), (32, 0.6, "overlap"), (8, 0.1, "overlap")])
def test_bad_tiling_settings_are_refused(vae, size, overlap, message):
    with pytest.raises(CallError, match=message):
        vae.enable_tiling(size, overlap)
    assert not vae.use_tiling


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda v: v.decode(torch.randn(1, 3, 4, 4)), "latent_channels"),
        (lambda v: v.encode(torch.randn(1, 3, 5, 8)), "multiples of"),
        (lambda v: v.encode(torch.randn(1, 4, 8, 8)), "in_channels"),
        (lambda v: v.decode(torch.randn(4, 4, 4)), "4-d"),
    ],
)
def test_bad_inputs_raise_a_typed_error(vae, call, message):
    with pytest.raises(CallError, match=message):
        call(vae)


def test_encode_and_decode_go_through_an_accelerate_hook(vae):
    """With accelerate's cpu_offload the weights live in a hook's weights map (the module holds meta
    tensors): decode/encode must run the hook like forward does, or they would compute on meta."""
    latents, images = latents_for(vae, height=8, width=8), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected_decode, expected_encode, expected_forward = vae.decode(latents), vae.encode(images).mean, vae(images)
        cpu_offload(vae, execution_device=torch.device("cpu"))
        assert vae.decoder.conv_in.weight.is_meta
        assert_same_output(vae.decode(latents), expected_decode)
        assert_same_output(vae.encode(images).mean, expected_encode)
        assert_same_output(vae(images), expected_forward)
    remove_hook_from_module(vae, recurse=True)
