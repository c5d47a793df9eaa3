"""The presets built from diffusers and transformers classes, each a pipeline folder the commands read as any other:

- the real pipelines (`flux` = FLUX.1-dev, `sdxl`, `sd35-large`, `wan2.1-t2v-14b`, ...): their published configs
  (`data/`), stand-in tokenizers and the published scheduler (`real_folders`), no weights: to plan and inspect,
  built on meta; there is nothing to run.
- `tiny-flux`: diffusers' FluxPipeline with the same classes as `flux` (CLIPTextModel, T5EncoderModel,
  FluxTransformer2DModel, AutoencoderKL) at tiny configs and random weights seeded with 0, saved: runs on the CPU.
- `tiny-sd15`: diffusers' StableDiffusionPipeline with the classes of `sd15` (CLIPTextModel, UNet2DConditionModel,
  AutoencoderKL) at diffusers' own test sizes, random weights seeded with 0: the runnable UNet example.

A preset's folder is written once, into `$PLACEMENT_CACHE_DIR/presets`, else `$XDG_CACHE_HOME/pipeline-placement/
presets`, else `~/.cache/pipeline-placement/presets` (never the working directory), under a name that holds a
fingerprint of its configs and of the diffusers and transformers versions that write it (another version writes
another folder). It is written into a temporary sibling and renamed into place, so processes started together (the
replicas of one run) never read half a folder."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from ..errors import LoadError
from ..hf.quiet import HF_LIBRARIES, quiet
from . import real_folders

# CLI name: the family in data/ (real_pipelines.json, extra_pipelines.json).
REAL_PRESETS = {"flux": "flux1-dev", "sd15": "sd15", "sdxl": "sdxl-base-1.0", "sd3-medium": "sd3-medium",
                "sd35-large": "sd35-large", "wan2.1-t2v-14b": "wan2.1-t2v-14b"}

# FLUX.1-dev's layout at the sizes diffusers' own FluxPipeline tests use (get_dummy_components), with a two-block
# VAE (8x fewer pixels per latent than FLUX's, as a real VAE downsamples) and FLUX.1-dev's guidance embedding.
TINY_FLUX = {
    "text_encoder": ("transformers", "CLIPTextModel", {
        "hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 55, "max_position_embeddings": real_folders.CLIP_LENGTH, "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": 1, "projection_dim": 32, "hidden_act": "quick_gelu"}),
    "text_encoder_2": ("transformers", "T5EncoderModel", {
        "vocab_size": 60, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4}),
    "transformer": ("diffusers", "FluxTransformer2DModel", {
        "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "guidance_embeds": True,
        "axes_dims_rope": [4, 4, 8]}),
    "vae": ("diffusers", "AutoencoderKL", {
        "in_channels": 3, "out_channels": 3, "block_out_channels": [4, 8], "layers_per_block": 1,
        "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
        "latent_channels": 4, "norm_num_groups": 2, "sample_size": 32, "use_quant_conv": False,
        "use_post_quant_conv": False, "shift_factor": 0.1159, "scaling_factor": 0.3611}),
}
# Stable Diffusion 1.5's layout (the UNet example) at the sizes diffusers' own StableDiffusionPipeline tests use
# (get_dummy_components), with sd15's published VAE scaling factor.
TINY_SD15 = {
    "text_encoder": ("transformers", "CLIPTextModel", {
        "hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4, "num_hidden_layers": 5,
        "vocab_size": 1000, "max_position_embeddings": real_folders.CLIP_LENGTH, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 1, "layer_norm_eps": 1e-05}),
    "unet": ("diffusers", "UNet2DConditionModel", {
        "block_out_channels": [4, 8], "layers_per_block": 1, "sample_size": 32, "in_channels": 4,
        "out_channels": 4, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "cross_attention_dim": 32, "norm_num_groups": 2}),
    "vae": ("diffusers", "AutoencoderKL", {
        "in_channels": 3, "out_channels": 3, "block_out_channels": [4, 8], "layers_per_block": 1,
        "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
        "latent_channels": 4, "norm_num_groups": 2, "sample_size": 64, "scaling_factor": 0.18215}),
}
TINY_PRESETS = {"tiny-flux": ("FluxPipeline", TINY_FLUX), "tiny-sd15": ("StableDiffusionPipeline", TINY_SD15)}
FOLDER_PRESETS = (*TINY_PRESETS, *REAL_PRESETS)
SEED = 0


def is_folder_preset(name: str) -> bool:
    return name in TINY_PRESETS or name in REAL_PRESETS


def has_weights(name: str) -> bool:
    return name in TINY_PRESETS


def preset_folder(name: str) -> Path:
    """The folder of preset `name`, written into the user's cache the first time (module doc)."""
    pipeline_class, modules = _specs(name)
    home = presets_home()
    folder = home / f"{name}-{_fingerprint(name, pipeline_class, modules)}"
    if (folder / "model_index.json").is_file():
        return folder
    home.mkdir(parents=True, exist_ok=True)
    draft = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=home))
    try:
        with quiet(preload=HF_LIBRARIES):  # their "Writing model shards" bars: the folder is the library's business
            _write(draft, name, pipeline_class, modules)
        draft.rename(folder)
    except OSError:
        if not (folder / "model_index.json").is_file():  # not a twin process that renamed its copy first
            raise
    finally:
        shutil.rmtree(draft, ignore_errors=True)
    return folder


def describe(name: str) -> str:
    """One line: the preset's diffusers class, each module component's class, and where its numbers come from."""
    pipeline_class, modules = _specs(name)
    parts = ", ".join(f"{component} {class_name}" for component, (_, class_name, _) in modules.items())
    origin = (f"{REAL_PRESETS[name]}'s published configs, built on meta (no weights)" if name in REAL_PRESETS
              else f"tiny configs, random weights (seed {SEED})")
    return f"Preset {name}: diffusers' {pipeline_class} ({parts}); {origin}."


def presets_home() -> Path:
    from placement.machine_profile import profile_path

    return profile_path().parent / "presets"  # the cache folder the machine profile lives in (its env variables)


def _specs(name: str) -> tuple[str, dict[str, tuple[str, str, dict]]]:
    if name in TINY_PRESETS:
        return TINY_PRESETS[name]
    if name in REAL_PRESETS:
        return real_folders.module_specs(REAL_PRESETS[name])
    raise LoadError(f"Unknown preset {name!r}; the presets built from diffusers classes are "
                    f"{', '.join(FOLDER_PRESETS)}.")


def _fingerprint(name: str, pipeline_class: str, modules: dict) -> str:
    import diffusers
    import transformers

    described = json.dumps([name, pipeline_class, modules, has_weights(name) and SEED, diffusers.__version__,
                            transformers.__version__], sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:12]


def _write(folder: Path, name: str, pipeline_class: str, modules: dict[str, tuple[str, str, dict]]) -> None:
    real_folders.write_specs(folder, pipeline_class, modules)
    if has_weights(name):
        for component, spec in modules.items():
            _seeded_module(*spec).save_pretrained(folder / component)


def _seeded_module(library: str, class_name: str, config: dict):
    """The module with random weights drawn from SEED alone (the caller's global RNG is left as it was)."""
    import diffusers
    import torch
    import transformers

    cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        module = cls.from_config(config) if library == "diffusers" else cls(cls.config_class(**config))
    return module.eval()
