"""Memory-saving methods of Pipeline (model/sequential/group offload, VAE slicing and tiling)."""


class PipelineMemoryMixin:
    """Mixed into `pipelines.Pipeline`; each method installs hooks that `reset_device_map()` removes."""
