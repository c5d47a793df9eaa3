"""TextEncoder: a CLIP/T5-like transformer encoder returning `(last_hidden_state, pooled_output)`.

Pooling: the last token the attention mask keeps (CLIP; the EOS of a right-padded batch) or the mean over
kept tokens (T5-style), then the projection when `projection_dim` is set."""

from __future__ import annotations

from enum import Enum
from typing import ClassVar, NamedTuple

import torch
from pydantic import PositiveInt, model_validator
from torch import nn

from ...errors import CallError
from ...framework.modeling import ModelConfig, ModelMixin
from .layers import Activation, Attention, FeedForward, NormKind, check_rank, make_norm
from ...folder.class_registry import library_class


class Pooling(str, Enum):
    LAST_TOKEN = "last_token"
    MEAN = "mean"


class TextEncoderConfig(ModelConfig):
    vocab_size: PositiveInt = 49408
    hidden_size: PositiveInt = 768
    num_layers: PositiveInt = 12
    num_heads: PositiveInt = 12
    intermediate_size: PositiveInt = 3072
    max_position_embeddings: PositiveInt = 77
    activation: Activation = Activation.QUICK_GELU
    norm: NormKind = NormKind.LAYER_NORM
    norm_eps: float = 1e-5
    bias: bool = True
    causal: bool = True
    pooling: Pooling = Pooling.LAST_TOKEN
    projection_dim: PositiveInt | None = None

    @model_validator(mode="after")
    def _heads_divide_width(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        return self

    @property
    def pooled_dim(self) -> int:
        return self.projection_dim or self.hidden_size


class TextEncoderOutput(NamedTuple):
    """A NamedTuple so accelerate's hooks move it between devices like any tuple of tensors."""

    last_hidden_state: torch.Tensor
    pooled_output: torch.Tensor


class TextEmbeddings(nn.Module):
    """Token + learned position embeddings in one module, so a device map never puts the two apart."""

    def __init__(self, config: TextEncoderConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.token_embedding(input_ids) + self.position_embedding(positions)[None]


class TextEncoderLayer(nn.Module):
    def __init__(self, config: TextEncoderConfig):
        super().__init__()
        head_dim = config.hidden_size // config.num_heads
        self.norm1 = make_norm(config.norm, config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config.hidden_size, heads=config.num_heads, head_dim=head_dim,
                                   qkv_bias=config.bias, out_bias=config.bias)
        self.norm2 = make_norm(config.norm, config.hidden_size, config.norm_eps)
        self.mlp = FeedForward(config.hidden_size, config.intermediate_size, config.activation, bias=config.bias)
        self.causal = config.causal

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x), mask=mask, causal=self.causal)
        return x + self.mlp(self.norm2(x))


@library_class
class TextEncoder(ModelMixin):
    """CLIP-like (`causal`, quick-GELU, last-token pooling) or T5-like (bidirectional, gated GELU, RMSNorm)."""

    config_class = TextEncoderConfig
    _no_split_modules = ["TextEmbeddings", "TextEncoderLayer"]
    presets: ClassVar[dict[str, TextEncoderConfig]] = {
        "tiny": TextEncoderConfig(
            vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
            max_position_embeddings=32, projection_dim=32,
        ),
        "tiny-t5": TextEncoderConfig(
            vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
            max_position_embeddings=32, activation=Activation.GATED_GELU, norm=NormKind.RMS_NORM, bias=False,
            causal=False, pooling=Pooling.MEAN,
        ),
        # CLIP ViT-L/14 text tower (SD 1.x, SDXL's first encoder, Flux's pooled encoder): ~123M.
        "clip-l": TextEncoderConfig(),
        # OpenCLIP ViT-bigG/14 text tower with projection (SDXL's second encoder): ~695M.
        "clip-g": TextEncoderConfig(
            hidden_size=1280, num_layers=32, num_heads=20, intermediate_size=5120, activation=Activation.GELU,
            projection_dim=1280,
        ),
        # T5 v1.1 XXL encoder (Flux, SD3): ~4.7B. Learned absolute positions stand in for T5's relative bias.
        "t5-xxl": TextEncoderConfig(
            vocab_size=32128, hidden_size=4096, num_layers=24, num_heads=64, intermediate_size=10240,
            max_position_embeddings=512, activation=Activation.GATED_GELU, norm=NormKind.RMS_NORM, norm_eps=1e-6,
            bias=False, causal=False, pooling=Pooling.MEAN,
        ),
    }

    def __init__(self, config: TextEncoderConfig):
        super().__init__(config)
        self.embeddings = TextEmbeddings(config)
        self.layers = nn.ModuleList(TextEncoderLayer(config) for _ in range(config.num_layers))
        self.final_norm = make_norm(config.norm, config.hidden_size, config.norm_eps)
        projection = config.projection_dim
        self.projection = nn.Linear(config.hidden_size, projection, bias=False) if projection else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TextEncoderOutput:
        self._check_inputs(input_ids, attention_mask)
        keep = None if attention_mask is None else attention_mask.to(device=input_ids.device, dtype=torch.bool)
        # (B, 1, 1, S): every query may look at the kept keys only.
        mask = None if keep is None else keep[:, None, None, :]
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        hidden = self.final_norm(hidden)
        pooled = self._pool(hidden, keep)
        if self.projection is not None:
            pooled = self.projection(pooled)
        return TextEncoderOutput(last_hidden_state=hidden, pooled_output=pooled)

    def _pool(self, hidden: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if self.config.pooling is Pooling.MEAN:
            if keep is None:
                return hidden.mean(dim=1)
            weights = keep.to(hidden.dtype)[:, :, None]
            return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        if keep is None:
            return hidden[:, -1]
        # Index of the last kept token (the EOS of a right-padded sequence), not the EOS id: robust to any ids.
        positions = torch.arange(keep.shape[1], device=keep.device)
        last = torch.where(keep, positions, -1).amax(dim=1).clamp(min=0)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last.to(hidden.device)]

    def _check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        name, config = type(self).__name__, self.config
        check_rank(name, "input_ids", input_ids, 2, "(batch, sequence)")
        if input_ids.shape[1] > config.max_position_embeddings:
            raise CallError(
                f"{name}: input_ids has {input_ids.shape[1]} tokens but config.max_position_embeddings is "
                f"{config.max_position_embeddings}; tokenize with max_length <= {config.max_position_embeddings}."
            )
        if input_ids.numel() and not input_ids.is_meta:
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= config.vocab_size:
                raise CallError(
                    f"{name}: token ids span [{low}, {high}] but config.vocab_size is {config.vocab_size}; "
                    f"use a tokenizer whose vocabulary fits."
                )
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise CallError(
                f"{name}: attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                f"{tuple(input_ids.shape)}; they must match."
            )
