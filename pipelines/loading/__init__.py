"""The one loader of models and pipelines: a request resolved once, one meta builder, one plan, one placer.

request.py            LoadOptions: every keyword of from_pretrained / plan_placement, written once (the entries'
                      signatures are made from it); LoadRequest: the options, and the folder (after the Hub),
                      device_map as what it is (a saved plan read as one), dtypes, accelerators, ...
meta.py               build_component -> MetaComponent: the module on meta in its load dtypes, its weights index,
                      and its reader: ours (streaming) or the format's owner (quantizers, renamed keys); fp8
                      layerwise casting as a load option: planned at stored bytes, applied at load
limits.py             the bounds a folder's configs and a call must keep (sizes, depths, repeat counts)
formats.py            load options of formats of their own; what each quantized format can do once placed;
                      components read from a single-file checkpoint (diffusers' from_single_file, GGUF)
placing.py            place_component: weights read to the planned devices, the kind's runtime, one undo; the
                      OWNER reader: the owner's load with our map, its hooks replaced by our runtime
planning.py           the plan of a pipeline's (or one model's) module components
memory_techniques.py  VAE tiling/slicing turned on where a decode does not fit, and the advice when none fits
suggestions.py        the single change (fp8, int8, nf4) that would make a plan fit, found by re-planning
assembly.py           the pipeline object around the components (ours, generic, or the diffusers class)
pipeline_loader.py    Pipeline.from_pretrained / plan_placement; pipelines.place: a pipeline already built, placed
                      as a load would place it
single_model.py       pipelines.load_model / plan_model: one model of any family, as its own class;
                      ModelMixin.from_pretrained / plan_placement: a one-component load
"""
