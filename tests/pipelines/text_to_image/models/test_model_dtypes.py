"""Every tiny reference model runs in half precision (all inputs cast, timesteps as given) close to float32."""

from __future__ import annotations

import pytest
import torch

from pipelines.text_to_image.models import AutoencoderKL, DiT, TextEncoder, UNet

from reference_inputs import denoiser_inputs, text_inputs, tiny


def forward(model, dtype):
    with torch.no_grad():
        if isinstance(model, TextEncoder):
            return model(*text_inputs(model)).last_hidden_state
        if isinstance(model, AutoencoderKL):
            return model(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)).to(dtype))
        latents, timestep, context, pooled = denoiser_inputs(model)
        return model(latents.to(dtype), timestep, context.to(dtype), pooled.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cls, preset", [(TextEncoder, "tiny"), (TextEncoder, "tiny-t5"), (UNet, "tiny"),
                                         (DiT, "tiny"), (AutoencoderKL, "tiny")])
def test_half_precision_forward_stays_close_to_float32(cls, preset, dtype):
    model = tiny(cls, preset)
    reference = forward(model, torch.float32)
    output = forward(model.to(dtype), dtype)
    assert output.dtype == dtype
    # bf16 keeps 8 bits of mantissa: a few percent of the output's range after a dozen layers.
    assert (output.float() - reference).abs().max() < 0.1 * reference.abs().max()
