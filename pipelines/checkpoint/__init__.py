"""The checkpoint folder format: file names and variants, atomic sharded saving, streaming loads, errors.

Works for any `nn.Module` (ours, diffusers', transformers'):

    weights = find_weights(folder, weights_name="diffusion_pytorch_model", variant=None)  # "model" for transformers
    with accelerate.init_empty_weights():
        module = build(config)
    load_weights(module, weights, device_map={"": "cpu"}, dtype=torch.float16, keep_in_fp32=("norm",))
"""

from .errors import (
    CheckpointError,
    CheckpointDtypeError,
    CheckpointKeysError,
    CheckpointReadError,
    CheckpointSaveError,
    CheckpointShapeError,
    CorruptCheckpointError,
    InvalidConfigError,
    UnsafeCheckpointPathError,
    VariantNotFoundError,
    WeightsNotFoundError,
)
from .index import TensorEntry, WeightsIndex, find_weights, read_header
from .loading import check_accelerators_exist, load_weights, target_dtype, tie_weights
from .naming import CONFIG_NAME, DIFFUSERS_WEIGHTS_NAME, TRANSFORMERS_WEIGHTS_NAME, WeightsNaming, variants_in
from .placing import cast_meta, disk_offload_index, load_component, stream_component
from .saving import atomic_folder, save_weights
from .validation import validate_weights

__all__ = [
    "CONFIG_NAME",
    "DIFFUSERS_WEIGHTS_NAME",
    "TRANSFORMERS_WEIGHTS_NAME",
    "CheckpointError",
    "CheckpointDtypeError",
    "CheckpointKeysError",
    "CheckpointReadError",
    "CheckpointSaveError",
    "CheckpointShapeError",
    "CorruptCheckpointError",
    "InvalidConfigError",
    "TensorEntry",
    "UnsafeCheckpointPathError",
    "VariantNotFoundError",
    "WeightsIndex",
    "WeightsNaming",
    "WeightsNotFoundError",
    "atomic_folder",
    "cast_meta",
    "check_accelerators_exist",
    "disk_offload_index",
    "load_component",
    "find_weights",
    "load_weights",
    "read_header",
    "save_weights",
    "target_dtype",
    "stream_component",
    "tie_weights",
    "validate_weights",
    "variants_in",
]
