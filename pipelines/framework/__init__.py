"""The user base classes, for people who write their own models and pipelines. Their folder entry points hand
over to `pipelines.loading` (load, plan) and `pipelines.folder` (what a folder is, saving a pipeline).

modeling.py   ModelConfig (the pydantic schema of a model's config.json) and ModelMixin (a model: config, save,
              load with a device map, diffusers' memory methods)
pipeline.py   Pipeline (from_pretrained, plan_placement, save_pretrained, offload techniques)
"""

from .modeling import ModelConfig, ModelMixin
from .pipeline import Pipeline

__all__ = ["ModelConfig", "ModelMixin", "Pipeline"]
