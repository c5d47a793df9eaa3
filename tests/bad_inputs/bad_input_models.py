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


# ---- diffusers folders (the [hf] extra), for the cases about formats of their own -------------------------------

FLUX = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def tiny_flux_transformer(folder):
    """A tiny FLUX transformer saved by diffusers into `folder`."""
    import diffusers

    torch.manual_seed(0)
    diffusers.FluxTransformer2DModel(**FLUX).save_pretrained(folder)
    return folder


def tiny_flux_preset(folder):
    """The `tiny-flux` preset's folder (diffusers' FluxPipeline at tiny configs, seeded) copied into `folder`."""
    import shutil

    from pipelines.presets import catalog

    shutil.copytree(catalog.preset_folder("tiny-flux"), folder, dirs_exist_ok=True)
    return folder


def tiny_flux_pipeline(folder):
    """A tiny FluxPipeline saved by diffusers (tokenizers and encoders from the e2e tests' tiny parts)."""
    import sys
    from pathlib import Path

    import diffusers
    import transformers

    e2e = str(Path(__file__).resolve().parents[1] / "pipelines" / "e2e")
    if e2e not in sys.path:
        sys.path.insert(0, e2e)
    from tiny_parts import clip_config, clip_tokenizer, flow_vae, t5_encoder, t5_tokenizer

    torch.manual_seed(0)
    diffusers.FluxPipeline(
        transformer=diffusers.FluxTransformer2DModel(**FLUX), text_encoder=transformers.CLIPTextModel(clip_config()),
        tokenizer=clip_tokenizer(folder.parent / "vocab"), text_encoder_2=t5_encoder(), tokenizer_2=t5_tokenizer(),
        vae=flow_vae(1), scheduler=diffusers.FlowMatchEulerDiscreteScheduler()).save_pretrained(folder)
    return folder


def wrong_rank_lora(transformer, folder):
    """A LoRA for `transformer` whose lora_B matrices have twice the rank of its lora_A ones, saved by diffusers."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_k"]))
    state = get_peft_model_state_dict(transformer)
    transformer.delete_adapters("default")
    wrong = {key: torch.zeros(value.shape[0], 2 * value.shape[1]) if "lora_B" in key else value
             for key, value in state.items()}
    diffusers.FluxPipeline.save_lora_weights(folder, transformer_lora_layers=wrong)
    return folder
