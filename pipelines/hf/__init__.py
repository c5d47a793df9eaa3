"""The bridge to diffusers and transformers: how their model classes are built and loaded, diffusers pipeline
classes built around our placed components, their `from_pretrained` spellings, and the calls of their families."""
