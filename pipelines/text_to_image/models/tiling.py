"""Run a spatial function over overlapping tiles and blend the results linearly (the VAE's tiled decode/encode).

Each tile's output is weighted by a separable ramp that rises linearly across the overlap with a neighbour
and is flat elsewhere (and at the image border); the canvas is the weighted sum divided by the summed
weights. The weights are continuous and positive inside every tile, so the blend has no seams, whatever
the number of tiles that overlap a pixel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True, kw_only=True)
class TileGrid:
    """Tile placement along one axis: `starts` of tiles of `size` input pixels covering `length`."""

    length: int
    size: int
    starts: tuple[int, ...]

    @classmethod
    def cover(cls, length: int, size: int, overlap: int, align: int = 1) -> "TileGrid":
        """Fewest tiles of `size` overlapping by at least `overlap`, evenly spread, starts multiples of `align`.

        The last tile ends exactly at `length`, so every tile is full-size (no thin last tile).
        """
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
        """The blend weight of tile `index` along this axis, in output pixels (input pixels x `scale`)."""
        out_size = round(self.size * scale)
        position = torch.arange(out_size, dtype=torch.float32, device=device) + 0.5
        weight = torch.ones(out_size, dtype=torch.float32, device=device)
        start = self.starts[index]
        if index > 0:  # ramp up across the overlap with the previous tile
            overlap = (self.starts[index - 1] + self.size - start) * scale
            weight = torch.minimum(weight, position / overlap)
        if index < len(self.starts) - 1:  # ramp down across the overlap with the next tile
            overlap = (start + self.size - self.starts[index + 1]) * scale
            weight = torch.minimum(weight, (out_size - position) / overlap)
        return weight.to(dtype)


def blend_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    tile_size: int,
    overlap: int,
    scale: float,
    align: int = 1,
) -> torch.Tensor:
    """`fn(x)` computed tile by tile. `fn` maps an (B, C, h, w) tile to (B, C', h*scale, w*scale).

    `align` keeps tile starts on multiples of it, so that with a downscaling `fn` (scale < 1) every tile's
    output lands on whole output pixels.
    """
    height, width = x.shape[-2:]
    rows = TileGrid.cover(height, tile_size, overlap, align)
    cols = TileGrid.cover(width, tile_size, overlap, align)
    canvas = weight_sum = None
    for i, top in enumerate(rows.starts):
        for j, left in enumerate(cols.starts):
            tile = fn(x[..., top:top + rows.size, left:left + cols.size])
            if canvas is None:
                out_h, out_w = round(height * scale), round(width * scale)
                canvas = tile.new_zeros(*tile.shape[:-2], out_h, out_w)
                weight_sum = tile.new_zeros(out_h, out_w)
            weight = (rows.weights(i, scale, tile.device, tile.dtype)[:, None]
                      * cols.weights(j, scale, tile.device, tile.dtype)[None, :])
            out_top, out_left = round(top * scale), round(left * scale)
            region = (..., slice(out_top, out_top + tile.shape[-2]), slice(out_left, out_left + tile.shape[-1]))
            canvas[region] += tile * weight
            weight_sum[region[1:]] += weight
    return canvas / weight_sum
