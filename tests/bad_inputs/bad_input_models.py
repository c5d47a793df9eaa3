"""Tiny models and a pipeline for the bad-input catalogue (a user's own classes, saved under this module path)."""

from __future__ import annotations

import torch
from torch import nn

from pipelines import ModelConfig, ModelMixin, Pipeline


class CatalogueEncoderConfig(ModelConfig):
    vocab: int = 16
    width: int = 8


class CatalogueEncoder(ModelMixin):
    config_class = CatalogueEncoderConfig

    def __init__(self, config: CatalogueEncoderConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab, config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.register_buffer("position_ids", torch.arange(4, dtype=torch.int64))

    def forward(self, ids):
        return self.proj(self.embed(ids)).mean(dim=1)


class CatalogueDecoder(ModelMixin):
    config_class = CatalogueEncoderConfig

    def __init__(self, config: CatalogueEncoderConfig):
        super().__init__(config)
        self.out = nn.Linear(config.width, config.width)

    def forward(self, x):
        return self.out(x)


class CataloguePipeline(Pipeline):
    model_graph = [("encoder", "decoder")]

    def __init__(self, encoder, decoder):
        super().__init__()
        self.register_components(encoder=encoder, decoder=decoder)


class NoLoader:
    """A non-module class with no from_pretrained: a folder naming it cannot be loaded."""


def tiny_pipeline(seed: int = 0) -> CataloguePipeline:
    torch.manual_seed(seed)
    config = CatalogueEncoderConfig()
    return CataloguePipeline(encoder=CatalogueEncoder(config), decoder=CatalogueDecoder(config))
