"""What a pipeline folder is: model_index.json, component sources (local or Hub), the class registry, the
component state and saving it. Imports nothing: `placement --help` must not import torch."""
