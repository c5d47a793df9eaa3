"""Pure planning: sizes, devices, the model graph, strategies and the Plan. Never loads weights."""

from .activations.estimate import ActivationEstimateError, CallEstimate, estimate_activations, estimate_call
from .planner import plan
from .budgets import Budgets, ZeroBudgetWarning, resolve_budgets
from .component_options import FormatLimit, TechniqueChoices
from .devices import Device, normalize_device
from .errors import DoesNotFitError, InvalidDeviceError, PlacementError, PlanError
from .graph import build_graph, execution_order
from .memory_model import ACCELERATOR_RUNTIME_OVERHEAD
from .plan_schema import ComponentPlan, ComponentTransfer, DevicePlan, Fallback, PlacementKind, Plan
from .pricing import ComponentWork, Mode, price
from .replicas import ReplicaFit, ReplicaGroup, ReplicaPlan, plan_replicas
from .sizes import format_size, parse_size
from .unit_order import trace_module_order

__all__ = [
    "FormatLimit", "TechniqueChoices",
    "ACCELERATOR_RUNTIME_OVERHEAD", "ActivationEstimateError", "Budgets", "CallEstimate", "ComponentPlan",
    "ComponentWork", "Mode",
    "ComponentTransfer", "Device", "DevicePlan", "DoesNotFitError", "Fallback", "InvalidDeviceError",
    "PlacementError", "PlanError", "PlacementKind", "Plan", "ReplicaFit", "ReplicaGroup", "ReplicaPlan",
    "ZeroBudgetWarning", "build_graph", "estimate_activations", "estimate_call", "execution_order", "format_size",
    "normalize_device", "parse_size", "plan", "plan_replicas", "price", "resolve_budgets", "trace_module_order"
]
