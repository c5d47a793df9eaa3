"""The bridge to diffusers and transformers: how their model classes are built and loaded, diffusers pipeline
classes built around our placed components, their `from_pretrained` spellings, and the calls of their families.

hf_interop.py          construct / retie / load_without_device_map per family of module class
diffusers_pipeline.py  a folder naming a diffusers pipeline class loads as that class
diffusers_saving.py    its save_pretrained once placed: diffusers' own save through our atomic save
hf_spellings.py        diffusers' from_pretrained spellings (dtype=, use_safetensors, Hub keywords)
quantizers.py          quantization configs per component, the owners' quantizers preparing the meta model
single_file.py         single-file checkpoints (safetensors, GGUF) built on meta by diffusers' single-file path
owner_loading.py       OwnerLoad: the owner's from_pretrained / from_single_file given our plan's map and dtype;
                       whether transformers' key renaming explains a checkpoint's original key names
calls/                 the inputs each diffusers pipeline family's call feeds its components (call= planning)
quiet.py               silences what other libraries print during our plans and loads (ours stays)
adapters.py            adapters (LoRA, ...) loaded on a placed pipeline follow their layer (hooks.edit_placed_weights)
"""
