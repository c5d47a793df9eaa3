"""The checkpoint folder format: file names, configs, atomic sharded saving, validation and tensor streaming, for
any `nn.Module`. It imports no other subpackage of `pipelines`: where tensors go is decided in `loading`."""

from ..errors import CheckpointSaveError, CheckpointShapeError, WeightsNotFoundError
from .index import TensorEntry, WeightsIndex, check_dtypes, find_weights, read_header, validate_weights
from .streaming import load_dtypes, load_weights, stream_weights, target_dtype, tie_weights
from .files import CONFIG_NAME, DIFFUSERS_WEIGHTS_NAME, TRANSFORMERS_WEIGHTS_NAME, WeightsNaming, variants_in
from .saving import atomic_folder, save_weights

__all__ = [
    "CONFIG_NAME",
    "DIFFUSERS_WEIGHTS_NAME",
    "TRANSFORMERS_WEIGHTS_NAME",
    "CheckpointSaveError",
    "CheckpointShapeError",
    "TensorEntry",
    "WeightsIndex",
    "WeightsNaming",
    "WeightsNotFoundError",
    "atomic_folder",
    "check_dtypes",
    "find_weights",
    "load_dtypes",
    "load_weights",
    "read_header",
    "save_weights",
    "stream_weights",
    "target_dtype",
    "tie_weights",
    "validate_weights",
    "variants_in",
]
