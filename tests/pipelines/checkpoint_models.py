"""Tiny user-defined models for the checkpoint, modeling and dispatch tests (a few KB of weights)."""

from __future__ import annotations

import torch
from torch import nn

from pipelines import ModelConfig, ModelMixin


class TinyConfig(ModelConfig):
    vocab: int = 32
    width: int = 16
    depth: int = 4


class Block(nn.Module):
    """A residual MLP block; a device map must never cut it (it is in `_no_split_modules`)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        # A persistent buffer with real content: accelerate's disk offload would drop it by default.
        self.register_buffer("gate", torch.rand(width))
        self.register_buffer("calls", torch.zeros(1), persistent=False)

    def forward(self, hidden):
        return hidden + self.gate * self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(hidden))))


class TinyModel(ModelMixin):
    config_class = TinyConfig
    _no_split_modules = ["Block"]
    _keep_in_fp32_modules = ["norm_out"]
    _tied_weights_keys = {"head.weight": "embed.weight"}

    def __init__(self, config: TinyConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(Block(config.width) for _ in range(config.depth))
        self.norm_out = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.arange(4, dtype=torch.int64))

    def forward(self, ids):
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        hidden = self.norm_out(hidden.to(self.norm_out.weight.dtype)).to(self.head.weight.dtype)
        return self.head(hidden) + self.steps.sum().to(hidden.dtype)


class PlainConfig(ModelConfig):
    width: int = 8


class PlainModel(ModelMixin):
    """No `_no_split_modules`, no ties: diffusers refuses device_map="auto" for such a class; we place it."""

    config_class = PlainConfig

    def __init__(self, config: PlainConfig):
        super().__init__(config)
        self.first = nn.Linear(config.width, config.width)
        self.second = nn.Linear(config.width, config.width)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def tiny_model(seed: int = 0, **fields) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel(TinyConfig(**fields)).eval()


def tiny_ids(config: TinyConfig, batch: int = 2, length: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, config.vocab, (batch, length), generator=generator)


def saved_bytes(model) -> int:
    """What save_pretrained writes: every tensor of the state dict except the tied copies."""
    tied = set(model._tied_weights_keys or ())
    return sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n not in tied)
