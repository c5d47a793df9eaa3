"""The checkpoint folder format: file names and variants, config files, atomic sharded saving, dtype and key
validation, tensor streaming, errors. It imports neither `hooks` nor any other subpackage of `pipelines`: where
tensors go is decided above it (`pipelines.loading`).

Works for any `nn.Module` (ours, diffusers', transformers'):

    weights = find_weights(folder, weights_name="diffusion_pytorch_model", variant=None)  # "model" for transformers
    with accelerate.init_empty_weights():
        module = build(config)
    load_weights(module, weights, device_map={"": "cpu"}, dtype=torch.float16, keep_in_fp32=("norm",))
"""

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
