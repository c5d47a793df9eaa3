"""The transfer model's two inputs to `placement.plan`, checked: `runs_per_call` and `link_bandwidth`."""

from __future__ import annotations

from typing import Mapping, Optional

from ..errors import PlanError
from ..plan_schema import DEFAULT_LINK_BANDWIDTH
from ..sizes import parse_size


def check_runs_per_call(runs_per_call: Optional[Mapping], modules: Mapping) -> dict[str, int]:
    """`{component: runs}` as given, every name a module component and every value a positive int."""
    if runs_per_call is None:
        return {}
    if not isinstance(runs_per_call, Mapping):
        raise PlanError(
            f"runs_per_call must be a dict {{component: runs per call}} such as {{'transformer': 28}}, got "
            f"{runs_per_call!r}."
        )
    unknown = [name for name in runs_per_call if name not in modules]
    if unknown:
        raise PlanError(
            f"runs_per_call names components that do not exist: {unknown}. The module components are "
            f"{list(modules)}."
        )
    bad = {name: runs for name, runs in runs_per_call.items()
           if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1}
    if bad:
        raise PlanError(
            f"runs_per_call values must be ints >= 1 (how many times the component runs per pipeline call, e.g. "
            f"28 denoising steps, or 56 where guidance runs as a second pass); got {bad}."
        )
    return dict(runs_per_call)


def check_link_bandwidth(link_bandwidth) -> float:
    """Bytes per second: None -> the default (25 GB/s, PCIe 4.0 x16); a positive number; or a size string
    ("25GB", "12.5 GiB") read as that much per second."""
    if link_bandwidth is None:
        return DEFAULT_LINK_BANDWIDTH
    if isinstance(link_bandwidth, bool):
        value = None
    elif isinstance(link_bandwidth, (int, float)):
        value = float(link_bandwidth)
    else:
        try:
            value = float(parse_size(link_bandwidth))
        except PlanError:
            value = None
    if value is None or not value > 0 or value == float("inf"):
        raise PlanError(
            f"link_bandwidth={link_bandwidth!r}: expected host -> accelerator bytes per second, a positive number "
            "(25e9) or a size read per second ('25GB'); None assumes 25 GB/s (PCIe 4.0 x16)."
        )
    return value
