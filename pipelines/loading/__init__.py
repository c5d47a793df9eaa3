"""The one loader of models and pipelines: a request resolved once, one meta builder, one plan, one placer.

options.py          LoadOptions: every keyword of from_pretrained / plan_placement, written once (the entries'
                    signatures are made from it)
request.py          LoadRequest: the options, and the folder (after the Hub), device_map as what it is, dtypes,
                    accelerators, ...
meta.py             build_component -> MetaComponent: the module on meta in its load dtypes, its weights index,
                    and its reader (meta_records.py): ours (streaming) or the format's owner (owner_meta.py)
owner_meta.py       components prepared on meta as their owner prepares them (quantizers, renamed keys)
single_files.py     components read from a single-file checkpoint (diffusers' from_single_file, GGUF)
layerwise.py        fp8 layerwise casting as a load option: planned at stored bytes, applied at load
placing.py          place_component: weights read to the planned devices, the kind's runtime, one undo
owner_reading.py    the OWNER reader: the owner's load with our map, its hooks replaced by our runtime
formats.py          load options of formats of their own; what each quantized format can do once placed
suggestions.py      the single change (fp8, int8, nf4) that would make a plan fit, found by re-planning
single_model.py     pipelines.load_model / plan_model: one model of any family, as its own class
planning.py         the plan of a pipeline's (or one model's) module components; saved_plans.py: plans as device_map
memory_techniques.py  VAE tiling/slicing turned on where a decode does not fit; vae_fit_advice.py when none fits
assembly.py         the pipeline object around the components (ours, generic, or the diffusers class)
pipeline_loader.py  Pipeline.from_pretrained / plan_placement
model_loader.py     ModelMixin.from_pretrained / plan_placement: a one-component load
place.py            pipelines.place: a pipeline already built, placed as a load would place it
"""
