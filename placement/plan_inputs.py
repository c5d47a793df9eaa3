"""What a plan was asked for (`Plan.inputs`), so that a JSON file says what it answers."""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, StrictInt

from .devices import normalize_device

PlanDevice = Annotated[Union[StrictInt, str], AfterValidator(normalize_device)]


class PlanInputs(BaseModel):
    """What the plan was asked for, so that a JSON file says what it answers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Any  # as given: a name, a device, or {component: device | {submodule: device}}
    max_memory: Optional[dict[PlanDevice, int]]  # in bytes; None: detected on the planning machine
    dtype: Union[None, str, dict[str, Optional[str]]]  # None: each tensor's own dtype
    call: Optional[dict[str, Any]] = None  # the call planned for (None: weights only)
    offload_folder: Optional[str] = None
    runs_per_call: Optional[dict[str, int]] = None  # as given (components not named run once)
    link_bandwidth: Optional[float] = None  # bytes/s as given (None: the default was assumed)
    gpu: Optional[str] = None  # the GPU profile's key, as named (None: detected or assumed)
    # The accelerators the planning machine had (virtual ones included); a plan for more is simulated for them
    # (`Plan.simulated_accelerators`). None in files written before it was recorded.
    accelerators_present: Optional[int] = None

    @classmethod
    def record(cls, *, strategy, max_memory, dtype, offload_folder, call=None, runs_per_call=None,
               link_bandwidth=None, accelerators_present=None, gpu=None) -> "PlanInputs":
        """The inputs as JSON can hold them: devices and dtypes as strings, budgets in bytes."""
        return cls(strategy=_plain(strategy), max_memory=max_memory, dtype=_plain(dtype),
                   offload_folder=None if offload_folder is None else str(offload_folder), call=call,
                   runs_per_call=None if runs_per_call is None else dict(runs_per_call),
                   link_bandwidth=link_bandwidth, accelerators_present=accelerators_present, gpu=gpu)


def _plain(value: Any) -> Any:
    """torch.device / torch.dtype -> "cuda:1" / "bfloat16"; dicts recursively; ints, strings and None as they are."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (int, str)):
        return value
    return str(value).removeprefix("torch.")
