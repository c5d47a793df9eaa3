"""Runtime: applies a placement Plan to real modules (dispatch, input-moving hooks, offloading, casting)."""

from .group_offload.offload import (
    GroupOffloadHook,
    GroupOffloadingConfig,
    GroupOffloadSession,
    OffloadType,
    apply_group_offloading,
    group_offloading_session,
    remove_group_offloading,
)
from .memory_errors import OffloadConfigError, OffloadConflictError
from .layerwise_casting import LayerwiseCastingConfig, apply_layerwise_casting, remove_layerwise_casting
from .model_offload import ModelOffloadChain, ModelOffloadConfig, apply_model_cpu_offload, remove_model_cpu_offload
from .offload_devices import resolve_execution_device
from .techniques import Technique, check_compatible
from .sequential_offload import SequentialOffloadConfig, apply_sequential_cpu_offload, remove_sequential_cpu_offload
