"""The bridge to diffusers and transformers: how their model classes are built and loaded, diffusers pipeline
classes built around our placed components, their `from_pretrained` spellings, and the calls of their families.

diffusers_pipeline.py  a folder naming a diffusers pipeline class loads as that class; its save_pretrained once
                       placed: diffusers' own save through our atomic save
loading_keywords.py    diffusers' from_pretrained spellings (dtype=, use_safetensors, Hub keywords) and loading
                       keywords
quantizers.py          quantization configs per component, the owners' quantizers preparing the meta model
single_file.py         single-file checkpoints (safetensors, GGUF) built on meta by diffusers' single-file path
owner_loading.py       OwnerLoad: the owner's from_pretrained / from_single_file given our plan's map and dtype;
                       whether transformers' key renaming explains a checkpoint's original key names;
                       construct / retie / load_without_device_map per family of module class
calls/                 the inputs each diffusers pipeline family's call feeds its components (call= planning)
quiet.py               silences what other libraries print during our plans and loads (ours stays)
adapters.py            adapters (LoRA, ...) loaded on a placed pipeline follow their layer (hooks.edit_placed_weights)
"""
