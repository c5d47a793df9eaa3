"""The framework, for people who write their own models and pipelines: `ModelMixin`, `Pipeline`, their
configs, the folder format (`model_index.json`, per-component folders), loading, planning and saving, and the
bridge to diffusers/transformers classes.

modeling.py     ModelMixin (a model: config, save, load with a device map)
pipeline.py     Pipeline (components, model graph, placement state) + memory.py (offload techniques)
loading.py      from_pretrained / plan_placement: build on meta, plan, stream, dispatch
planning.py     a pipeline's plan: graph, dtypes, pins, call-aware activations
saving.py       save_pretrained
sources.py, model_index.py, hub.py, hf_interop.py   where each component comes from and how it is built
config.py, component_config.py   pydantic configs of models and of non-module components
"""

from .config import ModelConfig
from .modeling import ModelMixin
from .pipeline import Pipeline

__all__ = ["ModelConfig", "ModelMixin", "Pipeline"]
