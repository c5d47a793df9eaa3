"""Reference models: real architectures in miniature, each a `ModelMixin` with `presets` ("tiny" and real sizes).

Denoisers (`UNet`, `DiT`) share one call: `denoiser(latents, timestep, encoder_hidden_states, pooled=None)`."""

from .autoencoder_kl import AutoencoderKL, AutoencoderKLConfig, DiagonalGaussian
from .dit import DiT, DiTConfig
from .layers import Activation, NormKind
from .text_encoder import Pooling, TextEncoder, TextEncoderConfig, TextEncoderOutput
from .unet import UNet, UNetConfig

__all__ = [
    "Activation",
    "AutoencoderKL",
    "AutoencoderKLConfig",
    "DiT",
    "DiTConfig",
    "DiagonalGaussian",
    "NormKind",
    "Pooling",
    "TextEncoder",
    "TextEncoderConfig",
    "TextEncoderOutput",
    "UNet",
    "UNetConfig",
]
