"""What a pipeline folder is: its model_index.json, where each component's class and files come from, the Hub,
one-save snapshots, the registry of classes a folder may name, the pipeline state object and saving it.

model_index.py     model_index.json: [library, ClassName] per component; classes resolved without imports; a
                   load is a snapshot of one save
class_registry.py  the classes a folder may name (library classes, registered user classes)
sources.py         the folder's components: class, family (ours, diffusers, transformers, non-module), subfolder;
                   a local folder, or a Hub id downloaded with only the files a load needs
components.py      PipelineComponents: components, model graph, placement state, where each came from; saving a
                   pipeline: model_index.json + one subfolder per component, atomically

This __init__ imports nothing: the package face (`pipelines/__init__.py`) imports `class_registry` at import
time, and `placement --help` must not import torch.
"""
