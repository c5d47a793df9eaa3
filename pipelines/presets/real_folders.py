"""Folders of the real pipelines to plan (the real presets, `placement plan flux`, and the benchmarks), written from the published facts in `data/`: no weights, no download.

Planning a pipeline for its call runs the pipeline's own `__call__` (call capture), so a folder needs, besides each
module component's `config.json`, the small parts that call uses: a tokenizer per text encoder, the scheduler and
the image processors. Their files are not in `data/`; stand-ins of the same kinds are written here:
- tokenizers built from a vocabulary made here (single letters for CLIP and T5, words for the LLMs), with each
  kind's real maximum length (CLIP 77; the pipelines give T5 and the LLMs theirs). CLIP and T5 pad to it as the
  real ones do, so their encoders see the real shapes; LLM prompt templates (HunyuanVideo's) count one token per
  word or punctuation mark, about what the real BPE vocabularies give;
- the scheduler class the pipeline is published with, at its class defaults (timesteps and runs per call come
  from the pipeline's code and `num_inference_steps`; a shift changes values only);
- image processors at their class defaults.

    folder = write_folder(tmp / "flux", "flux1-dev")                 # real depth (planning builds it on meta)
    folder = write_folder(tmp / "flux", "flux1-dev", depth=1)        # every block count cut to 1 (tests)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"  # package data (pyproject.toml)
PIPELINES: dict[str, dict] = {
    **json.loads((DATA / "real_pipelines.json").read_text())["pipelines"],
    **json.loads((DATA / "extra_pipelines.json").read_text())["pipelines"],
}
CLIP_LENGTH = 77

# Config keys that count repeated blocks: cut to `depth` when asked (the widths stay real).
_DEPTH_KEYS = ("num_layers", "num_single_layers", "num_hidden_layers", "num_decoder_layers", "num_refiner_layers",
               "layers_per_block", "depth")
# The scheduler each family is published with (its model_index.json); by class name, built at its defaults.
# The settings that change how many steps run: PNDM's published configs skip its Runge-Kutta warm-up steps.
_SCHEDULERS = {"StableDiffusionPipeline": ("PNDMScheduler", {"skip_prk_steps": True, "steps_offset": 1}),
               "StableDiffusionXLPipeline": ("EulerDiscreteScheduler", {"steps_offset": 1}),
               "PixArtSigmaPipeline": ("DPMSolverMultistepScheduler", {}),
               "CogVideoXPipeline": ("CogVideoXDDIMScheduler", {}), "SanaPipeline": ("DPMSolverMultistepScheduler", {})}
_FLOW_MATCH = "FlowMatchEulerDiscreteScheduler"
# The tokenizer class a text encoder is published with, by the encoder's class.
_LLM_TOKENIZERS = {"Gemma2Model": "GemmaTokenizerFast", "LlamaModel": "LlamaTokenizerFast",
                   "LlamaForCausalLM": "PreTrainedTokenizerFast", "Qwen2_5_VLForConditionalGeneration": "Qwen2TokenizerFast"}


def shallow(config: dict, depth: int = 1) -> dict:
    """`config` with every block count cut to `depth` (SDXL's per-block transformer depths too)."""
    reduced = dict(config)
    for key in _DEPTH_KEYS:
        if isinstance(reduced.get(key), int):
            reduced[key] = depth
    if isinstance(reduced.get("num_hidden_layers"), int):  # HunyuanVideo reads the hidden states 3 from the end
        reduced["num_hidden_layers"] = max(depth, 3)
    if isinstance(reduced.get("transformer_layers_per_block"), list):
        reduced["transformer_layers_per_block"] = [depth] * len(reduced["transformer_layers_per_block"])
    if "llama_layers" in reduced:  # HiDream: one Llama layer's states per block, from the (cut) encoder
        reduced["llama_layers"] = [0] * (reduced["num_layers"] + reduced["num_single_layers"])
    if "fullatt_block_indexes" in reduced:  # Qwen2.5-VL's vision tower: indexes of its (now fewer) blocks
        reduced["fullatt_block_indexes"] = [0]
    for key in ("text_config", "vision_config"):  # composite configs (Qwen2.5-VL)
        if isinstance(reduced.get(key), dict):
            reduced[key] = shallow(reduced[key], depth)
    return reduced


def module_specs(key: str, *, depth: int | None = None) -> tuple[str, dict[str, tuple[str, str, dict]]]:
    """(pipeline class, {component: (library, class, config)}) for family `key`, required parts only."""
    entry = PIPELINES[key]
    return entry["pipeline_class"], {
        name: (spec["library"], spec["class"], spec["config"] if depth is None else shallow(spec["config"], depth))
        for name, spec in entry["components"].items() if not spec.get("optional")
    }


def write_folder(root: Path, key: str, *, depth: int | None = None) -> Path:
    """A folder of family `key` to plan (module doc): configs, tokenizers, scheduler, processors; no weights."""
    return write_specs(root, *module_specs(key, depth=depth))


def write_specs(root: Path, pipeline_class: str, modules: dict[str, tuple[str, str, dict]]) -> Path:
    """A folder of diffusers' `pipeline_class` with these module components' configs and the other parts."""
    root.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": pipeline_class, "_diffusers_version": "0.42.1"}
    for name, (library, class_name, config) in modules.items():
        index[name] = [library, class_name]
        (root / name).mkdir(exist_ok=True)
        (root / name / "config.json").write_text(json.dumps({"_class_name": class_name, **config}))
    for name, part in _other_parts(root, pipeline_class, modules).items():
        part.save_pretrained(root / name)
        index[name] = [type(part).__module__.split(".")[0], type(part).__name__]
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def _other_parts(root: Path, pipeline_class: str, modules: dict[str, tuple[str, str, dict]]) -> dict[str, Any]:
    """The tokenizers, scheduler and image processor the pipeline's __call__ uses."""
    import diffusers
    import inspect

    parts: dict[str, Any] = {}
    for name, (_, class_name, _) in modules.items():
        if name.startswith("text_encoder"):
            tokenizer = name.replace("text_encoder", "tokenizer")
            parts[tokenizer] = tokenizer_for(class_name, root / tokenizer)
        if name == "image_encoder":
            import transformers
            parts["image_processor"] = transformers.CLIPImageProcessor()
    scheduler, settings = _SCHEDULERS.get(pipeline_class, (_FLOW_MATCH, {}))
    parts["scheduler"] = getattr(diffusers, scheduler)(**settings)
    accepted = inspect.signature(getattr(diffusers, pipeline_class).__init__).parameters
    return {name: part for name, part in parts.items() if name in accepted}


def tokenizer_for(encoder_class: str, folder: Path):
    """A tokenizer of the kind `encoder_class` is published with (module doc), its files written in `folder`."""
    import transformers

    if encoder_class.startswith("CLIPText"):
        return clip_tokenizer(folder)
    if encoder_class in ("T5EncoderModel", "UMT5EncoderModel"):
        return t5_tokenizer(model_max_length=512)
    tokenizer_class = getattr(transformers, _LLM_TOKENIZERS.get(encoder_class, "PreTrainedTokenizerFast"))
    return tokenizer_class(tokenizer_object=_word_level(["<pad>", "<s>", "</s>", "<unk>"]), bos_token="<s>",
                           eos_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=4096)


def clip_tokenizer(folder: Path, length: int = CLIP_LENGTH):
    """A CLIP tokenizer: a byte-pair vocabulary of single letters, its files written in `folder`, padded to
    `length` (77, as CLIP's is)."""
    import transformers

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for index, letter in enumerate("abcdefghijklmnopqrstuvwxyz"):
        vocab[letter], vocab[letter + "</w>"] = 3 + index, 29 + index
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=length)


def t5_tokenizer(**keywords):
    """A T5 tokenizer: a unigram vocabulary of single letters."""
    import transformers

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(prefix + letter, -1.0) for letter in "abcdefghijklmnopqrstuvwxyz" for prefix in ("", "\u2581")]
    return transformers.T5TokenizerFast(vocab=pieces, extra_ids=0, **keywords)


def _word_level(specials: list[str]):
    """A word-level tokenizer: one token per word or punctuation mark; unknown words are the last special."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "a an the of on at in and with to photo lighthouse rocky coast dusk waves gulls warm light cat".split()
    vocab = {token: index for index, token in enumerate([*specials, *words, *".,:;!?'\"<>|_-()[]{}"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[-1]))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    return backend


def meta_pipeline(key: str, *, depth: int | None = None, root: Path | None = None):
    """The diffusers pipeline of family `key` as planning builds it: every module on meta from its config (weights
    tied after leaving `init_empty_weights`, which breaks ties made inside it), the other parts read from
    `write_folder`'s folder (written under `root`, a temporary folder by default)."""
    import tempfile

    import diffusers
    import transformers
    from accelerate import init_empty_weights

    folder = write_folder(Path(root or tempfile.mkdtemp()) / key, key, depth=depth)
    pipeline_class, specs = module_specs(key, depth=depth)
    modules = {}
    for name, (library, class_name, config) in specs.items():
        cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
        with init_empty_weights():
            module = cls.from_config(config) if library == "diffusers" else cls._from_config(cls.config_class(**config))
        if hasattr(module, "tie_weights"):
            module.tie_weights()
        modules[name] = module.eval()
    cls = getattr(diffusers, pipeline_class)
    expected, _ = cls._get_signature_keys(cls)
    index = json.loads((folder / "model_index.json").read_text())
    parts = {name: _load_part(folder / name, *index[name]) for name in expected
             if name not in modules and name in index}
    return cls(**{name: modules.get(name, parts.get(name)) for name in expected})


def _load_part(folder: Path, library: str, class_name: str):
    import diffusers
    import transformers

    owner = diffusers if library == "diffusers" else transformers
    return getattr(owner, class_name).from_pretrained(folder)


def captured(pipe, call: dict, *, dtype=None):
    """What `call` runs of each component of `pipe`, learned from its own `__call__` (call capture): the example
    calls, runs per call and activation peaks (at `dtype`) of `pipelines.loading.planning.describe_call`."""
    from pipelines.loading.planning import describe_call, modules_and_edges

    modules, _ = modules_and_edges(pipe)
    return describe_call(pipe, modules, call, dtypes=dtype)
