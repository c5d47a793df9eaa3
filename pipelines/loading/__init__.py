"""The one loader of models and pipelines: a request resolved once, one meta builder, one plan, one placer.

request.py          LoadRequest: folder (after the Hub), device_map as what it is, dtypes, accelerators, ...
meta.py             build_component -> MetaComponent: the module on meta in its load dtypes, its weights index
placing.py          place_component: weights read to the planned devices, the kind's runtime, one undo
planning.py         the plan of a pipeline's (or one model's) module components; saved_plans.py: plans as device_map
memory_techniques.py  VAE tiling/slicing turned on where a decode does not fit; vae_fit_advice.py when none fits
assembly.py         the pipeline object around the components (ours, generic, or the diffusers class)
pipeline_loader.py  Pipeline.from_pretrained / plan_placement
model_loader.py     ModelMixin.from_pretrained / plan_placement: a one-component load
place.py            pipelines.place: a pipeline already built, placed as a load would place it
"""
