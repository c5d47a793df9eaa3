"""AutoencoderKL: the VAE of latent diffusion, in diffusers' `AutoencoderKL` layout.

Pipelines scale as diffusers does: denoiser latents = (vae latents - shift_factor) * scaling_factor. Memory
savers, off by default: slicing (one sample at a time, equal to the plain call up to rounding) and tiling
(overlapping tiles blended by linear ramps; GroupNorm and the mid-block attention see one tile at a time, so
close to, not equal to, the plain call)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from pydantic import PositiveInt, model_validator
from torch import nn

from placement.activations.memo import same_work_by_layout

from ...errors import CallError
from ...folder.class_registry import library_class
from ...framework.modeling import ModelConfig, ModelMixin
from .layers import (
    Downsample2D,
    ResnetBlock2D,
    SpatialSelfAttention,
    Upsample2D,
    check_channels,
    check_rank,
    check_spatial_multiple,
)


class VAEMidBlock(nn.Module):
    """Resnet, single-head self-attention over all pixels, resnet."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.resnet_in = ResnetBlock2D(channels, channels, temb_channels=None, groups=groups)
        self.attention = SpatialSelfAttention(channels, groups=groups)
        self.resnet_out = ResnetBlock2D(channels, channels, temb_channels=None, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnet_out(self.attention(self.resnet_in(x)))


class ResampleBlock(nn.Module):
    """`num_layers` resnets then a down- or upsample (or neither, for the last level)."""

    def __init__(self, in_channels: int, out_channels: int, *, num_layers: int, groups: int,
                 resample: type[nn.Module] | None):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock2D(in_channels if i == 0 else out_channels, out_channels, temb_channels=None, groups=groups)
            for i in range(num_layers)
        )
        self.resample = resample(out_channels) if resample is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.resample is None else self.resample(x)


class Encoder(nn.Module):
    """Image (B, in_channels, H, W) -> posterior moments (B, 2*latent_channels, H/f, W/f)."""

    def __init__(self, in_channels: int, latent_channels: int, channels: tuple[int, ...], layers: int, groups: int):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            ResampleBlock(channels[max(i - 1, 0)], width, num_layers=layers, groups=groups,
                          resample=Downsample2D if i < len(channels) - 1 else None)
            for i, width in enumerate(channels)
        )
        self.mid_block = VAEMidBlock(channels[-1], groups)
        self.norm_out = nn.GroupNorm(groups, channels[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(channels[-1], 2 * latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class Decoder(nn.Module):
    """Latents (B, latent_channels, h, w) -> image (B, out_channels, h*f, w*f)."""

    def __init__(self, latent_channels: int, out_channels: int, channels: tuple[int, ...], layers: int, groups: int):
        super().__init__()
        reversed_channels = tuple(reversed(channels))
        self.conv_in = nn.Conv2d(latent_channels, reversed_channels[0], 3, padding=1)
        self.mid_block = VAEMidBlock(reversed_channels[0], groups)
        self.up_blocks = nn.ModuleList(
            ResampleBlock(reversed_channels[max(i - 1, 0)], width, num_layers=layers + 1, groups=groups,
                          resample=Upsample2D if i < len(channels) - 1 else None)
            for i, width in enumerate(reversed_channels)
        )
        self.norm_out = nn.GroupNorm(groups, channels[0], eps=1e-6)
        self.conv_out = nn.Conv2d(channels[0], out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


@dataclass(frozen=True, kw_only=True)
class DiagonalGaussian:
    """The encoder's posterior; `sample(generator)` and `mode()` give unscaled latents."""

    mean: torch.Tensor
    logvar: torch.Tensor

    @classmethod
    def from_moments(cls, moments: torch.Tensor) -> "DiagonalGaussian":
        mean, logvar = moments.chunk(2, dim=1)
        return cls(mean=mean, logvar=logvar.clamp(-30.0, 20.0))

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        # Draw on the generator's device (a CPU generator gives the same latents on every machine), then move.
        device = generator.device if generator is not None else self.mean.device
        noise = torch.randn(self.mean.shape, generator=generator, device=device, dtype=self.mean.dtype)
        return self.mean + self.std * noise.to(self.mean.device)

    def to(self, *args, **kwargs) -> "DiagonalGaussian":
        """Moved/cast like a tensor (accelerate's hooks call `.to(device)` on outputs that have it)."""
        return DiagonalGaussian(mean=self.mean.to(*args, **kwargs), logvar=self.logvar.to(*args, **kwargs))

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self) -> torch.Tensor:
        """KL divergence to N(0, I) per sample."""
        return 0.5 * (self.mean.pow(2) + self.logvar.exp() - 1.0 - self.logvar).sum(dim=(1, 2, 3))


@dataclass(frozen=True, kw_only=True)
class TileGrid:
    """Tile placement along one axis: `starts` of tiles of `size` input pixels covering `length`."""

    length: int
    size: int
    starts: tuple[int, ...]

    @classmethod
    def cover(cls, length: int, size: int, overlap: int, align: int = 1) -> "TileGrid":
        """Fewest full-size tiles overlapping by at least `overlap`, evenly spread, starts multiples of `align`."""
        if length <= size:
            return cls(length=length, size=length, starts=(0,))
        if not 0 < overlap < size:
            raise ValueError(f"tile overlap must be between 1 and the tile size - 1 ({size - 1}), got {overlap}")
        stride = size - overlap
        count = math.ceil((length - size) / stride) + 1
        span = length - size
        starts = tuple(align * round(span * i / (count - 1) / align) for i in range(count))
        return cls(length=length, size=size, starts=starts)

    def weights(self, index: int, scale: float, device, dtype) -> torch.Tensor:
        """Tile `index`'s blend weight in output pixels: a ramp across each overlap, flat elsewhere."""
        return _ramp(round(self.size * scale), *self._overlaps(index, scale), device=device, dtype=dtype)

    def all_weights(self, scale: float, device, dtype) -> list[torch.Tensor]:
        """Every tile's `weights`, each distinct ramp made once (evenly spread tiles share their overlaps)."""
        made: dict[tuple, torch.Tensor] = {}
        for index in range(len(self.starts)):
            overlaps = self._overlaps(index, scale)
            if overlaps not in made:
                made[overlaps] = _ramp(round(self.size * scale), *overlaps, device=device, dtype=dtype)
        return [made[self._overlaps(index, scale)] for index in range(len(self.starts))]

    def _overlaps(self, index: int, scale: float) -> tuple[float | None, float | None]:
        """The output pixels tile `index` shares with the tile before it and the one after it (None: no such tile)."""
        start = self.starts[index]
        before = (self.starts[index - 1] + self.size - start) * scale if index > 0 else None
        after = (start + self.size - self.starts[index + 1]) * scale if index < len(self.starts) - 1 else None
        return before, after


def _ramp(size: int, before: float | None, after: float | None, *, device, dtype) -> torch.Tensor:
    position = torch.arange(size, dtype=torch.float32, device=device) + 0.5
    weight = torch.ones(size, dtype=torch.float32, device=device)
    if before is not None:
        weight = torch.minimum(weight, position / before)
    if after is not None:
        weight = torch.minimum(weight, (size - position) / after)
    return weight.to(dtype)


def blend_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, tile_size: int, overlap: int,
                scale: float, align: int = 1) -> torch.Tensor:
    """`fn(x)` tile by tile, `fn` scaling h and w by `scale`; `align` keeps a downscaled tile on whole pixels."""
    height, width = x.shape[-2:]
    rows = TileGrid.cover(height, tile_size, overlap, align)
    cols = TileGrid.cover(width, tile_size, overlap, align)
    first = fn(x[..., :rows.size, :cols.size])
    out_h, out_w = round(height * scale), round(width * scale)
    canvas = first.new_zeros(*first.shape[:-2], out_h, out_w)
    weight_sum = first.new_zeros(out_h, out_w)
    row_weights = rows.all_weights(scale, first.device, first.dtype)
    col_weights = cols.all_weights(scale, first.device, first.dtype)
    for i, top in enumerate(rows.starts):
        for j, left in enumerate(cols.starts):
            if first is None:
                _blend_tile(fn, x, canvas, weight_sum, row_weights[i], col_weights[j], tile=(rows.size, cols.size),
                            scale=scale, at=(top, left))
            else:  # decoded already, for the canvas's shape
                _add_tile(first, canvas, weight_sum, row_weights[i], col_weights[j], scale=scale, at=(top, left))
                first = None
    return canvas / weight_sum


# Tiles of one shape do the same work wherever they are (`at` only says where they read and write): an estimate
# runs one tile of each kind and replays the others.
@same_work_by_layout(position="at")
def _blend_tile(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, canvas: torch.Tensor,
                weight_sum: torch.Tensor, row_weight: torch.Tensor, col_weight: torch.Tensor, *,
                tile: tuple[int, int], scale: float, at: tuple[int, int]) -> None:
    top, left = at
    decoded = fn(x[..., top:top + tile[0], left:left + tile[1]])
    _add_tile(decoded, canvas, weight_sum, row_weight, col_weight, scale=scale, at=at)


def _add_tile(decoded: torch.Tensor, canvas: torch.Tensor, weight_sum: torch.Tensor, row_weight: torch.Tensor,
              col_weight: torch.Tensor, *, scale: float, at: tuple[int, int]) -> None:
    """Add `decoded`, weighted, into the `canvas` region of the tile read at `at`, and its weight into `weight_sum`."""
    top, left = round(at[0] * scale), round(at[1] * scale)
    region = (slice(top, top + decoded.shape[-2]), slice(left, left + decoded.shape[-1]))
    weight = row_weight[:, None] * col_weight[None, :]
    canvas[(..., *region)] += decoded * weight
    weight_sum[region] += weight


Method = TypeVar("Method", bound=Callable)


def hooked_entry_point(method: Method) -> Method:
    """`encode`/`decode` through the model's accelerate hook (which replaces only `forward`).

    diffusers' `apply_forward_hook` runs only the pre-forward; the whole hook also returns the output as forward's."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        hook = getattr(self, "_hf_hook", None)
        if hook is None:
            return method(self, *args, **kwargs)
        args, kwargs = hook.pre_forward(self, *args, **kwargs)
        return hook.post_forward(self, method(self, *args, **kwargs))

    return wrapper  # type: ignore[return-value]


class AutoencoderKLConfig(ModelConfig):
    in_channels: PositiveInt = 3
    out_channels: PositiveInt = 3
    latent_channels: PositiveInt = 4
    block_out_channels: tuple[PositiveInt, ...] = (128, 256, 512, 512)
    layers_per_block: PositiveInt = 2
    norm_num_groups: PositiveInt = 32
    use_quant_conv: bool = True
    scaling_factor: float = 0.13025
    shift_factor: float = 0.0
    tile_sample_size: PositiveInt = 512
    tile_overlap_factor: float = 0.25

    @model_validator(mode="after")
    def _consistent(self):
        for channels in self.block_out_channels:
            if channels % self.norm_num_groups:
                raise ValueError(
                    f"block_out_channels entry {channels} must be a multiple of norm_num_groups ({self.norm_num_groups})"
                )
        if not 0.0 < self.tile_overlap_factor <= 0.5:
            raise ValueError(f"tile_overlap_factor must be in (0, 0.5], got {self.tile_overlap_factor}")
        return self


@library_class
class AutoencoderKL(ModelMixin):
    config_class = AutoencoderKLConfig
    _no_split_modules = ["ResnetBlock2D", "VAEMidBlock"]
    presets: ClassVar[dict[str, AutoencoderKLConfig]] = {
        "tiny": AutoencoderKLConfig(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                                    tile_sample_size=32),
        # Flux-like tiny: 16 latent channels, no quant convs, a shift factor.
        "tiny-16ch": AutoencoderKLConfig(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                                         latent_channels=16, use_quant_conv=False, scaling_factor=0.3611,
                                         shift_factor=0.1159, tile_sample_size=32),
        # SDXL's VAE: ~84M.
        "sdxl": AutoencoderKLConfig(),
        # FLUX.1's VAE: 16 latent channels, no quant convs: ~84M.
        "flux": AutoencoderKLConfig(latent_channels=16, use_quant_conv=False, scaling_factor=0.3611,
                                    shift_factor=0.1159),
    }

    def __init__(self, config: AutoencoderKLConfig):
        super().__init__(config)
        channels, layers, groups = config.block_out_channels, config.layers_per_block, config.norm_num_groups
        self.encoder = Encoder(config.in_channels, config.latent_channels, channels, layers, groups)
        self.decoder = Decoder(config.latent_channels, config.out_channels, channels, layers, groups)
        latent = config.latent_channels
        self.quant_conv = nn.Conv2d(2 * latent, 2 * latent, 1) if config.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(latent, latent, 1) if config.use_quant_conv else None
        self.use_slicing = False
        self.use_tiling = False
        self.tile_sample_size = config.tile_sample_size
        self.tile_overlap_factor = config.tile_overlap_factor

    @property
    def downsampling_factor(self) -> int:
        return 2 ** (len(self.config.block_out_channels) - 1)

    def enable_slicing(self) -> None:
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    def enable_tiling(self, tile_sample_size: int | None = None, overlap_factor: float | None = None) -> None:
        size = self.config.tile_sample_size if tile_sample_size is None else tile_sample_size
        overlap = self.config.tile_overlap_factor if overlap_factor is None else overlap_factor
        factor = self.downsampling_factor
        if size <= 0 or size % factor:
            raise CallError(
                f"AutoencoderKL.enable_tiling: tile_sample_size {size} must be a positive multiple of the "
                f"downsampling factor {factor}."
            )
        if not 0.0 < overlap <= 0.5 or int(size * overlap) < factor:
            raise CallError(
                f"AutoencoderKL.enable_tiling: overlap_factor {overlap} must be in (0, 0.5] and give at least "
                f"{factor} pixels of overlap on {size}-pixel tiles (it gives {int(size * overlap)})."
            )
        self.use_tiling, self.tile_sample_size, self.tile_overlap_factor = True, size, overlap

    def disable_tiling(self) -> None:
        self.use_tiling = False

    @hooked_entry_point
    def encode(self, images: torch.Tensor) -> DiagonalGaussian:
        return self._encode(images)

    @hooked_entry_point
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self._decode(latents)

    def forward(self, images: torch.Tensor, sample_posterior: bool = False,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """decode(encode(images)), from the posterior mean unless `sample_posterior`."""
        # Unhooked bodies: forward went through the hook already; a second pass would offload mid-call.
        posterior = self._encode(images)
        return self._decode(posterior.sample(generator) if sample_posterior else posterior.mode())

    def _encode(self, images: torch.Tensor) -> DiagonalGaussian:
        name = f"{type(self).__name__}.encode"
        check_rank(name, "images", images, 4, "(B, C, H, W)")
        check_channels(name, "images", images, self.config.in_channels, "in_channels")
        check_spatial_multiple(name, "images", images, self.downsampling_factor)
        return DiagonalGaussian.from_moments(self._batched(self._encode_moments, images))

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        name = f"{type(self).__name__}.decode"
        check_rank(name, "latents", latents, 4, "(B, C, h, w)")
        check_channels(name, "latents", latents, self.config.latent_channels, "latent_channels")
        return self._batched(self._decode_maybe_tiled, latents)

    def _batched(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.use_slicing and x.shape[0] > 1:
            return torch.cat([fn(sample) for sample in x.split(1)], dim=0)
        return fn(x)

    def _encode_moments(self, images: torch.Tensor) -> torch.Tensor:
        size, factor = self.tile_sample_size, self.downsampling_factor
        if self.use_tiling and max(images.shape[-2:]) > size:
            return blend_tiles(self._encode_tile, images, tile_size=size,
                               overlap=int(size * self.tile_overlap_factor), scale=1 / factor, align=factor)
        return self._encode_tile(images)

    def _encode_tile(self, images: torch.Tensor) -> torch.Tensor:
        moments = self.encoder(images)
        return moments if self.quant_conv is None else self.quant_conv(moments)

    def _decode_maybe_tiled(self, latents: torch.Tensor) -> torch.Tensor:
        factor = self.downsampling_factor
        tile = self.tile_sample_size // factor
        if self.use_tiling and max(latents.shape[-2:]) > tile:
            return blend_tiles(self._decode_tile, latents, tile_size=tile,
                               overlap=max(1, int(tile * self.tile_overlap_factor)), scale=factor)
        return self._decode_tile(latents)

    def _decode_tile(self, latents: torch.Tensor) -> torch.Tensor:
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        return self.decoder(latents)
