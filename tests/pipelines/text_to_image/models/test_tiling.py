"""blend_tiles / TileGrid: tiles cover the input, overlaps blend to exactly the untiled result for local maps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st

from pipelines.text_to_image.models.autoencoder_kl import TileGrid, blend_tiles
from same_output import assert_same_output


@settings(max_examples=100, deadline=None)
@given(
    align=st.sampled_from([1, 2, 8]),
    tiles=st.integers(1, 12),
    extra=st.integers(0, 40),
    overlap_fraction=st.sampled_from([0.125, 0.25, 0.5]),
)
def test_tile_grid_covers_the_axis_with_full_aligned_overlapping_tiles(align, tiles, extra, overlap_fraction):
    size = 8 * tiles
    length = size + align * extra
    overlap = max(align, int(size * overlap_fraction))
    assume(overlap < size)
    grid = TileGrid.cover(length, size, overlap, align)
    assert grid.starts[0] == 0 and grid.starts[-1] + grid.size == length
    assert all(start % align == 0 for start in grid.starts)
    assert list(grid.starts) == sorted(grid.starts)
    for previous, current in zip(grid.starts, grid.starts[1:]):
        assert previous + grid.size - current >= max(1, overlap - align)  # overlap (rounding costs < align)
    for index in range(len(grid.starts)):
        assert (grid.weights(index, 1.0, "cpu", torch.float32) > 0).all()


def test_input_smaller_than_a_tile_is_one_tile():
    grid = TileGrid.cover(10, 32, 8)
    assert grid.starts == (0,) and grid.size == 10


def test_overlap_as_large_as_the_tile_is_refused():
    with pytest.raises(ValueError, match="overlap"):
        TileGrid.cover(100, 16, 16)


def test_blending_a_pointwise_map_reproduces_it_exactly():
    """For a map without spatial context every tile agrees on the overlap, so the normalised blend must give
    back the untiled result: the weights form a partition of unity, with any number of overlapping tiles."""
    x = torch.randn(2, 3, 37, 53)
    weight = torch.randn(5, 3, 1, 1)

    def upscale(tile):
        return F.interpolate(F.conv2d(tile, weight), scale_factor=4, mode="nearest")

    expected = upscale(x)
    tiled = blend_tiles(upscale, x, tile_size=12, overlap=3, scale=4)
    assert_same_output(tiled, expected)


def test_blending_a_downscaling_map_with_aligned_tiles():
    x = torch.randn(1, 2, 64, 96)
    expected = F.avg_pool2d(x, 8)
    tiled = blend_tiles(lambda tile: F.avg_pool2d(tile, 8), x, tile_size=32, overlap=8, scale=1 / 8, align=8)
    assert_same_output(tiled, expected)
