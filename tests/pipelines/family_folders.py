"""Configs-only folders of the real diffusers families, at reduced depth and real widths, for call= tests.

The configs are the published ones (benchmarks/data/real_pipelines.json) with their depth cut (`shallow`), plus
for the families that file lacks, the classes' own defaults with the published widths (`EXTRA_FAMILIES`).
A folder holds model_index.json and one config.json per module component; planning builds them on meta.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights

_DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
REAL_PIPELINES = json.loads((_DATA / "real_pipelines.json").read_text())["pipelines"]
EXTRA_FAMILIES = json.loads((_DATA / "extra_pipelines.json").read_text())["pipelines"]

# Config keys that count repeated blocks, and the depth each keeps: the widths stay real.
_DEPTH_KEYS = {"num_layers": 1, "num_single_layers": 1, "num_hidden_layers": 1, "num_decoder_layers": 1,
               "num_refiner_layers": 1, "layers_per_block": 1, "depth": 1}


def shallow(config: dict) -> dict:
    """`config` with every block count cut to 1 (SDXL's per-block transformer depths to 1 each)."""
    reduced = dict(config)
    for key, depth in _DEPTH_KEYS.items():
        if isinstance(reduced.get(key), int):
            reduced[key] = depth
    if isinstance(reduced.get("transformer_layers_per_block"), list):
        reduced["transformer_layers_per_block"] = [1] * len(reduced["transformer_layers_per_block"])
    if "llama_layers" in reduced:  # HiDream: one Llama layer's states per block, from the (one-layer) encoder
        reduced["llama_layers"] = [0] * (reduced["num_layers"] + reduced["num_single_layers"])
    if "fullatt_block_indexes" in reduced:  # Qwen2.5-VL's vision tower: indexes of its (now one) blocks
        reduced["fullatt_block_indexes"] = [0]
    for key in ("text_config", "vision_config"):  # composite configs (Qwen2.5-VL)
        if isinstance(reduced.get(key), dict):
            reduced[key] = shallow(reduced[key])
    return reduced


def family_components(key: str) -> tuple[str, dict[str, tuple[str, str, dict]]]:
    """(pipeline class, {component: (library, class, shallow config)}) for a family key, required parts only."""
    entry = REAL_PIPELINES[key] if key in REAL_PIPELINES else EXTRA_FAMILIES[key]
    return entry["pipeline_class"], {
        name: (spec["library"], spec["class"], shallow(spec["config"]))
        for name, spec in entry["components"].items() if not spec.get("optional")
    }


def write_configs_folder(root: Path, key: str) -> Path:
    """A configs-only pipeline folder (no weights) for family `key`; planning needs nothing else."""
    pipeline_class, components = family_components(key)
    root.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": pipeline_class, "_diffusers_version": "0.42.1"}
    for name, (library, class_name, config) in components.items():
        index[name] = [library, class_name]
        (root / name).mkdir(exist_ok=True)
        (root / name / "config.json").write_text(json.dumps({"_class_name": class_name, **config}))
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def build_modules(key: str, *, device: str = "meta") -> tuple[str, dict[str, torch.nn.Module]]:
    """The family's shallow modules, on meta or with real (random) weights in float32."""
    import diffusers
    import transformers

    pipeline_class, components = family_components(key)
    modules = {}
    for name, (library, class_name, config) in components.items():
        cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
        torch.manual_seed(0)
        if device == "meta":
            with init_empty_weights():
                modules[name] = _build(cls, library, config)
        else:
            modules[name] = _as_measurable(_build(cls, library, config))
        modules[name].eval()
    return pipeline_class, modules


def _as_measurable(module: torch.nn.Module) -> torch.nn.Module:
    """Parameters a model passes as an argument to a submodule (Sana's `scale_shift_table`) turned into buffers
    of the same bytes: MemTracker hooks the gradient of every argument that requires one, which fails under
    inference mode. Buffers and parameters are both left out of the activation peak, so nothing changes."""
    for name, parameter in list(module.named_parameters()):
        if name.endswith("scale_shift_table"):
            owner_name, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            delattr(owner, attribute)
            owner.register_buffer(attribute, parameter.detach())
    return module


def _build(cls, library: str, config: dict):
    if library == "diffusers":
        return cls.from_config(config)
    return cls._from_config(cls.config_class(**config))

