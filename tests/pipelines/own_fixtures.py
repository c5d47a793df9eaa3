"""A user-defined pipeline with user-defined models on this library's own base classes (`pipelines.Pipeline`,
`ModelMixin`, `ModelConfig`), as release 0.1 users wrote them: kept for the tests of that own model world until it is
removed (issue 40); new tests use `pipeline_fixtures` (diffusers' DiffusionPipeline, ModelMixin + ConfigMixin).
Importable as `own_fixtures`, so model_index.json records it as the classes' library."""

from __future__ import annotations

import torch
from torch import nn

from pipelines import ModelConfig, ModelMixin, Pipeline


class EncoderConfig(ModelConfig):
    vocab: int = 16
    width: int = 8


class Encoder(ModelMixin):
    config_class = EncoderConfig

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab, config.width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).mean(dim=1)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class DenoiserConfig(ModelConfig):
    width: int = 8
    depth: int = 4


class Denoiser(ModelMixin):
    config_class = DenoiserConfig
    _no_split_modules = ["Block"]

    def __init__(self, config: DenoiserConfig):
        super().__init__(config)
        self.blocks = nn.ModuleList(Block(config.width) for _ in range(config.depth))
        self.register_buffer("scale", torch.full((config.width,), 0.5))

    def forward(self, x, context):
        x = x + context
        for block in self.blocks:
            x = block(x)
        return x * self.scale


class DecoderConfig(ModelConfig):
    width: int = 8
    out: int = 3


class Decoder(ModelMixin):
    config_class = DecoderConfig

    def __init__(self, config: DecoderConfig):
        super().__init__(config)
        self.proj = nn.Linear(config.width, config.out)

    def forward(self, x):
        return self.proj(x)


class TinyUserPipeline(Pipeline):
    model_graph = [("encoder", "denoiser"), ("denoiser", "decoder")]

    def __init__(self, encoder, denoiser, decoder, scheduler=None):
        super().__init__()
        self.register_components(encoder=encoder, denoiser=denoiser, decoder=decoder, scheduler=scheduler)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, steps: int = 3) -> torch.Tensor:
        context = self.encoder(ids.to(self.component_execution_device("encoder")))
        x = torch.zeros_like(context)
        for _ in range(steps):
            x = self.denoiser(x, context)
        return self.decoder(x).cpu()


def tiny_user_pipeline(seed: int = 0) -> TinyUserPipeline:
    torch.manual_seed(seed)
    return TinyUserPipeline(
        encoder=Encoder(EncoderConfig()).eval(), denoiser=Denoiser(DenoiserConfig()).eval(),
        decoder=Decoder(DecoderConfig()).eval(),
    )


USER_IDS = torch.tensor([[1, 2, 3], [4, 5, 6]])
