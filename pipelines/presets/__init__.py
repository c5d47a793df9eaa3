"""The presets built from diffusers and transformers classes (`flux`, `tiny-flux`, ...): folders written into the
user's cache from the real pipelines' published configs (catalog.py, real_folders.py, data/)."""
