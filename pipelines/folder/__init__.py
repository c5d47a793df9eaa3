"""What a pipeline folder is: its model_index.json, where each component's class and files come from, the Hub,
one-save snapshots, the registry of classes a folder may name, the pipeline state object and saving it.

model_index.py        model_index.json: [library, ClassName] per component; classes resolved without imports
class_registry.py     the classes a folder may name (library classes, registered user classes)
component_classes.py  the family of a component class (ours, diffusers, transformers, non-module), OwnModel
sources.py            the folder's components: class, family, subfolder
hub.py                a local folder, or a Hub id downloaded with only the files a load needs
snapshot.py           a load is a snapshot of one save
components.py         PipelineComponents: components, model graph, placement state
pipeline_saving.py    save a pipeline: model_index.json + one subfolder per component, atomically

This __init__ imports nothing: the package face (`pipelines/__init__.py`) imports `class_registry` at import
time, and `placement --help` must not import torch.
"""
