"""The pipelines the tests load, all built from diffusers and transformers classes, seeded and saved into the test's
folder (no network):

- `save_preset(folder, "tiny-flux")`: the `tiny-flux` preset (diffusers' FluxPipeline: CLIP, T5, a FLUX transformer
  and a two-block AutoencoderKL at tiny configs); `save_preset(folder, "tiny-sd")`: a Stable Diffusion 1.5-style
  pipeline (UNet2DConditionModel, CLIPTextModel, AutoencoderKL, EulerDiscreteScheduler, a local CLIPTokenizer).
  Each returns the folder and the unplaced pipeline read back by diffusers' own `from_pretrained`: diffusers' own
  run, what a placed run is compared with.
- `TinyUserPipeline`: a user-defined pipeline with user-defined models, as a user writes them in diffusers: a
  `DiffusionPipeline` subclass whose models are `ModelMixin` + `ConfigMixin` with `@register_to_config`. Importable
  as `pipeline_fixtures`, so model_index.json records this module as the classes' library.

Shared helpers: `generate` (one seeded call at small sizes), `has_hooks`, `holds_no_copy`."""

from __future__ import annotations

import shutil
from pathlib import Path

import diffusers
import torch
import transformers
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from pipelines.presets import catalog, real_folders


# ---- the presets: diffusers pipelines at tiny configs ----

def tiny_flux_folder(folder: Path) -> Path:
    """The `tiny-flux` preset's folder (written once per process into the suite's cache), copied into `folder` so
    that a test may change it."""
    shutil.copytree(catalog.preset_folder("tiny-flux"), folder, dirs_exist_ok=True)
    return folder


def deeper_flux_folder(folder: Path, seed: int = 1, **transformer) -> Path:
    """The `tiny-flux` preset with its transformer's config changed by `transformer` (e.g. more single-stream
    blocks) and its weights drawn from `seed`."""
    tiny_flux_folder(folder)
    config = {**catalog.TINY_FLUX["transformer"][2], **transformer}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = diffusers.FluxTransformer2DModel.from_config(config).eval()
    shutil.rmtree(folder / "transformer")
    model.save_pretrained(folder / "transformer")
    return folder


def tiny_flux_on_meta() -> diffusers.FluxPipeline:
    """The `tiny-flux` preset's pipeline with every module built on meta from its config (as planning builds them),
    its tokenizers and scheduler read from the preset's folder."""
    from accelerate import init_empty_weights

    modules = {}
    for name, (library, class_name, config) in catalog.TINY_FLUX.items():
        cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
        with init_empty_weights():
            module = cls.from_config(config) if library == "diffusers" else cls(cls.config_class(**config))
        if hasattr(module, "tie_weights"):
            module.tie_weights()  # ties made inside init_empty_weights are broken on leaving it
        modules[name] = module.eval()
    return diffusers.FluxPipeline.from_pretrained(catalog.preset_folder("tiny-flux"), **modules)


CLIP_LENGTH = 16  # the tiny CLIP's position table and its tokenizer's padding length (as diffusers' tests use)


def tiny_sd_pipeline(vocab_folder: Path) -> diffusers.StableDiffusionPipeline:
    """A Stable Diffusion 1.5-style pipeline at the sizes of diffusers' own tests (`get_dummy_components`), every
    module drawn from seed 0; the tokenizer's files written in `vocab_folder`."""
    def seeded(make):
        torch.manual_seed(0)
        return make().eval()

    return diffusers.StableDiffusionPipeline(
        unet=seeded(lambda: diffusers.UNet2DConditionModel(
            block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, norm_num_groups=1,
            attention_head_dim=4)),
        vae=seeded(lambda: diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(4, 8), layers_per_block=1, latent_channels=4,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            norm_num_groups=2, sample_size=32)),
        text_encoder=seeded(lambda: transformers.CLIPTextModel(transformers.CLIPTextConfig(
            hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=55,
            max_position_embeddings=CLIP_LENGTH, bos_token_id=0, eos_token_id=1, pad_token_id=1,
            projection_dim=32))),
        tokenizer=real_folders.clip_tokenizer(vocab_folder, CLIP_LENGTH),
        scheduler=diffusers.EulerDiscreteScheduler(steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def tiny_sd_folder(folder: Path) -> Path:
    tiny_sd_pipeline(folder.parent / f".{folder.name}-vocab").save_pretrained(folder)
    return folder


PRESET_FOLDERS = {"tiny-flux": tiny_flux_folder, "tiny-sd": tiny_sd_folder}


def save_preset(folder: Path, name: str = "tiny-flux") -> tuple[Path, DiffusionPipeline]:
    """Preset `name` ("tiny-flux" or "tiny-sd") saved into `folder`, and diffusers' own pipeline read from it."""
    PRESET_FOLDERS[name](Path(folder))
    with torch.random.fork_rng(devices=[]):
        return folder, DiffusionPipeline.from_pretrained(folder).to("cpu")


CALL = dict(height=16, width=16, num_inference_steps=2, output_type="pt")


def generate(pipe, prompt: str = "a red cube", **overrides) -> torch.Tensor:
    """One seeded call with small sizes (images as a CPU tensor)."""
    arguments = {**CALL, **overrides}
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, generator=torch.Generator().manual_seed(0), **arguments).images.cpu()


def module_components(pipe) -> dict[str, nn.Module]:
    return {name: obj for name, obj in pipe.components.items() if isinstance(obj, nn.Module)}


def has_hooks(pipe_or_module) -> list[str]:
    """Paths of every submodule still carrying an accelerate hook."""
    modules = [("", pipe_or_module)] if isinstance(pipe_or_module, nn.Module) else module_components(
        pipe_or_module).items()
    return [f"{name}.{path}" for name, module in modules for path, sub in module.named_modules()
            if hasattr(sub, "_hf_hook")]


def holds_no_copy(offload: Path, checkpoint: Path) -> bool:
    """Whether `offload` holds no bytes of its own: nothing, or hard links to `checkpoint`'s files (disk-homed weights
    are served from the checkpoint, its files pinned by links at load: `hooks.pinned_files`)."""
    if not offload.exists():
        return True
    inodes = {path.stat().st_ino for path in checkpoint.rglob("*") if path.is_file()}
    return all(path.stat().st_ino in inodes for path in offload.rglob("*") if path.is_file())


# ---- a user-defined pipeline with user-defined models, as a user writes them in diffusers ----

class Encoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).mean(dim=1)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Denoiser(ModelMixin, ConfigMixin):
    _no_split_modules = ["Block"]

    @register_to_config
    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, x, context):
        x = x + context
        for block in self.blocks:
            x = block(x)
        return x * self.scale


class Decoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, width: int = 8, out: int = 3):
        super().__init__()
        self.proj = nn.Linear(width, out)

    def forward(self, x):
        return self.proj(x)


class TinyUserPipeline(DiffusionPipeline):
    model_cpu_offload_seq = "encoder->denoiser->decoder"
    _optional_components = ["scheduler"]

    def __init__(self, encoder: Encoder, denoiser: Denoiser, decoder: Decoder, scheduler=None):
        super().__init__()
        self.register_modules(encoder=encoder, denoiser=denoiser, decoder=decoder, scheduler=scheduler)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, steps: int = 3) -> torch.Tensor:
        context = self.encoder(ids.to(self._execution_device))
        x = torch.zeros_like(context)
        for _ in range(steps):
            x = self.denoiser(x, context)
        return self.decoder(x).cpu()


USER_CLASSES = (Encoder, Denoiser, Decoder, TinyUserPipeline)


def tiny_user_pipeline(seed: int = 0) -> TinyUserPipeline:
    torch.manual_seed(seed)
    return TinyUserPipeline(encoder=Encoder().eval(), denoiser=Denoiser().eval(), decoder=Decoder().eval())


USER_IDS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def component_bytes(pipe) -> dict[str, int]:
    """Each module component's state-dict bytes in its dtype (what a budget in a test is derived from)."""
    return {name: sum(t.numel() * t.element_size() for t in module.state_dict().values())
            for name, module in module_components(pipe).items()}


def budget(fraction: float, pipe) -> str:
    """`fraction` of the pipeline's weight bytes, as a budget string in bytes."""
    return f"{int(fraction * sum(component_bytes(pipe).values()))}B"
