"""The user base classes, for people who write their own models and pipelines. Their folder entry points hand
over to `pipelines.loading` (load, plan) and `pipelines.folder` (what a folder is, saving a pipeline).

config.py        ModelConfig: the pydantic schema of a model's config.json
modeling.py      ModelMixin (a model: config, save, load with a device map) + model_memory.py (diffusers' methods)
pipeline.py      Pipeline (from_pretrained, plan_placement, save_pretrained) + memory.py (offload techniques)
"""

from .config import ModelConfig
from .modeling import ModelMixin
from .pipeline import Pipeline

__all__ = ["ModelConfig", "ModelMixin", "Pipeline"]
