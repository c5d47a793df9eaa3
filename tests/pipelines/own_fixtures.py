"""A user-defined pipeline with user-defined models on this library's own base classes (`pipelines.Pipeline`,
`ModelMixin`, `ModelConfig`), as release 0.1 users wrote them: kept for the tests of that own model world until it is
removed (issue 40); new tests use `pipeline_fixtures` (diffusers' DiffusionPipeline, ModelMixin + ConfigMixin).
Importable as `own_fixtures`, so model_index.json records it as the classes' library."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pipelines import ModelConfig, ModelMixin, Pipeline, TextToImagePipeline


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
CALL = dict(height=16, width=16, num_inference_steps=2, output_type="pt")


def generate(pipe: TextToImagePipeline, **overrides) -> torch.Tensor:
    """One seeded call with small sizes (images as a CPU tensor)."""
    arguments = {**CALL, **overrides}
    return pipe("a red cube", generator=torch.Generator().manual_seed(0), **arguments).images.cpu()


def has_hooks(pipe_or_module) -> list[str]:
    """Paths of every submodule still carrying an accelerate hook."""
    modules = pipe_or_module.module_components.items() if isinstance(pipe_or_module, Pipeline) else [
        ("", pipe_or_module)
    ]
    return [f"{name}.{path}" for name, module in modules for path, sub in module.named_modules()
            if hasattr(sub, "_hf_hook")]


def save_preset(folder: Path, name: str = "tiny-dit") -> tuple[Path, TextToImagePipeline]:
    pipe = TextToImagePipeline.from_preset(name, seed=0)
    pipe.save_pretrained(folder)
    return folder, pipe


def holds_no_copy(offload: Path, checkpoint: Path) -> bool:
    """Whether `offload` holds no bytes of its own: nothing, or hard links to `checkpoint`'s files (disk-homed weights
    are served from the checkpoint, its files pinned by links at load: `hooks.pinned_files`)."""
    if not offload.exists():
        return True
    inodes = {path.stat().st_ino for path in checkpoint.rglob("*") if path.is_file()}
    return all(path.stat().st_ino in inodes for path in offload.rglob("*") if path.is_file())
