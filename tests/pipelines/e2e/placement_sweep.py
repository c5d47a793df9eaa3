"""The placement sweep: for a diffusers class of the e2e cases, the budgets at which the planner places a component
in each placement kind it can make, and the whole life of the pipeline placed so (load, call, LoRA load / fuse /
unfuse / unload, reset, save, reload), compared with diffusers' own run of the same folder. Importable as
`placement_sweep`; `python tests/pipelines/e2e/placement_sweep.py` prints the matrix (class x kind).

A kind is looked for on a ladder of budgets (one GPU holding a shrinking share of the weights, two GPUs that cannot
hold the denoiser whole, a CPU budget too small for the weights, no usable GPU), the denoiser first (the component
a LoRA goes into), then any component. A kind no budget of the ladder reaches is "not reachable", with what the
planner said of the denoiser at the budget meant for that kind (its refusal, or its fallback reason there)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipelines import Pipeline
from placement.errors import PlacementError
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD
from placement.plan_schema import ComponentPlan, PlacementKind, Plan

KINDS = ("whole", "split", "per call", "streamed", "cpu", "disk")
ROOMY = {0: "8GiB", "cpu": "8GiB"}
# Shares of the weights one GPU holds (beyond what the call charges it anyway), largest first.
SHARES = (1.2, 0.85, 0.65, 0.45, 0.25, 0.1)
# The ladder's label meant for each kind: where "not reachable" takes its reason from.
MEANT_FOR = {"whole": "1 GPU x 1.2", "split": "2 GPUs, 0.6 of the denoiser each", "per call": "1 GPU x 0.85",
             "streamed": "1 GPU x 0.45", "cpu": "no usable GPU", "disk": "disk, 1 GPU x 0.55"}


def kind_of(component: ComponentPlan) -> str:
    """The sweep's kind of a planned component: where its weights live between calls and how they move."""
    if component.execution_device == "cpu":
        return "cpu"
    if component.kind is PlacementKind.DISK or "disk" in component.devices:
        return "disk"
    transfer = component.transfer
    if transfer is not None and transfer.streamed_modules:
        return "streamed"
    if transfer is not None and transfer.per_call_modules:
        return "per call"
    return "split" if component.kind is PlacementKind.SPLIT else "whole"


def denoiser_of(plan: Plan) -> str:
    return next(name for name in ("transformer", "unet") if name in plan.components)


def budget_ladder(folder: Path, case) -> dict[str, dict]:
    """label -> max_memory, from roomy to none: GPU budgets are above what every plan with `call=` charges an
    accelerator anyway (the largest activation and the runtime overhead) by a share of the weights."""
    plan = Pipeline.plan_placement(folder, max_memory=ROOMY, call=case.planning_call, **case.load)
    denoiser = plan.components[denoiser_of(plan)].bytes
    weights = sum(component.bytes for component in plan.components.values())
    transient = max(component.activation_bytes or 0 for component in plan.components.values())
    base = transient + (ACCELERATOR_RUNTIME_OVERHEAD if case.planning_call is not None else 0)

    def gpus(bytes_each: float, count: int = 1, cpu: str = "4GiB") -> dict:
        return {**{index: f"{base + int(bytes_each)}B" for index in range(count)}, "cpu": cpu}

    ladder = {f"1 GPU x {share}": gpus(share * weights) for share in SHARES}
    # Two GPUs that cannot hold the denoiser whole: with half of the rest each, or with nothing more.
    ladder["2 GPUs, 0.6 of the denoiser and half of the rest each"] = gpus(0.6 * denoiser + (weights - denoiser) / 2,
                                                                            count=2)
    ladder["2 GPUs, 0.6 of the denoiser each"] = gpus(0.6 * denoiser, count=2)
    small_host = f"{int(0.15 * weights)}B"  # host RAM too small for the offloaded weights: the rest goes to disk
    ladder.update({f"disk, 1 GPU x {share}": gpus(share * weights, cpu=small_host) for share in (0.75, 0.55, 0.35)})
    ladder["no usable GPU"] = {0: "1B", "cpu": "4GiB"}
    return ladder


@dataclass
class Reach:
    """Where the sweep found a kind: the budget, and the component placed so (None: not reachable, `why`)."""

    kind: str
    max_memory: dict | None = None
    component: str | None = None
    why: str = ""
    budgets_tried: list[str] = field(default_factory=list)


def _plan(folder: Path, case, max_memory: dict, offload_folder: Path) -> Plan:
    return Pipeline.plan_placement(folder, max_memory=max_memory, call=case.planning_call,
                                   offload_folder=offload_folder,
                                   **case.load)


def reach(folder: Path, case, offload_folder: Path) -> dict[str, Reach]:
    """kind -> the first budget of the ladder placing the denoiser so, else any component; or why none does."""
    found: dict[str, Reach] = {}
    said: dict[str, tuple[str, str]] = {}  # label -> (the denoiser's kind there, what the planner said of it)
    ladder = budget_ladder(folder, case)
    for label, max_memory in ladder.items():
        try:
            plan = _plan(folder, case, max_memory, offload_folder)
        except PlacementError as error:
            said[label] = ("refused", f"refused at {label} ({max_memory}): {str(error).splitlines()[0]}")
            continue
        denoiser = denoiser_of(plan)
        for name in (denoiser, *plan.components):
            kind = kind_of(plan.components[name])
            if kind not in found or (found[kind].component != denoiser and name == denoiser):
                found[kind] = Reach(kind, max_memory, name)
        kind = kind_of(plan.components[denoiser])
        reasons = [fallback.reason for fallback in plan.fallbacks if fallback.component == denoiser]
        said[label] = (kind, f"at {label} the {denoiser} is {kind}: {reasons[0] if reasons else plan.verdict.headline}")
    return {kind: found.get(kind) or Reach(kind, why=_why_not(kind, list(ladder), said), budgets_tried=list(ladder))
            for kind in KINDS}


def _why_not(kind: str, labels: list[str], said: dict[str, tuple[str, str]]) -> str:
    """What the planner said at the budget meant for `kind`, or at the first smaller one where the denoiser is no
    longer whole (where the planner chose something else than `kind` for it, and says why)."""
    start = labels.index(MEANT_FOR[kind])
    for label in labels[start:]:
        if label in said and said[label][0] != "whole":
            return said[label][1]
    return said[MEANT_FOR[kind]][1] if MEANT_FOR[kind] in said else "no budget of the ladder"


def lora_targets(denoiser: torch.nn.Module) -> list[str]:
    """The attention projections a LoRA of this denoiser adapts (diffusers' attention names them so)."""
    names = {name.rsplit(".", 1)[-1] for name, module in denoiser.named_modules() if isinstance(module, torch.nn.Linear)}
    return sorted(names & {"to_q", "to_k", "to_v"})


def denoiser_attribute(pipe) -> str:
    return "transformer" if getattr(pipe, "transformer", None) is not None else "unet"


def takes_lora(pipe) -> bool:
    """Whether the class loads a LoRA into its denoiser: its pipeline's lora loader names the denoiser, and the
    denoiser takes peft adapters (Kandinsky 3's pipeline has a loader, its UNet no adapter support)."""
    name = denoiser_attribute(pipe)
    return hasattr(pipe, "load_lora_weights") and name in getattr(pipe, "_lora_loadable_modules", ()) \
        and hasattr(getattr(pipe, name), "add_adapter")


def make_lora(folder: Path, pipe, seed: int = 1) -> None:
    """A random LoRA of `pipe`'s denoiser, saved by its class' own `save_lora_weights`."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    name = denoiser_attribute(pipe)
    denoiser = getattr(pipe, name)
    torch.manual_seed(seed)
    denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=lora_targets(denoiser)))
    state = get_peft_model_state_dict(denoiser)
    denoiser.delete_adapters("default")
    type(pipe).save_lora_weights(folder, **{f"{name}_lora_layers": state})


def has_hooks(pipe) -> list[str]:
    modules = [(name, obj) for name, obj in pipe.components.items() if isinstance(obj, torch.nn.Module)]
    return [f"{name}.{path}" for name, module in modules for path, sub in module.named_modules()
            if hasattr(sub, "_hf_hook")]


def main() -> None:  # pragma: no cover - prints the matrix for a closing note
    import tempfile
    import warnings

    from cases import CASES

    warnings.filterwarnings("ignore")
    root = Path(tempfile.mkdtemp())
    print("| class | " + " | ".join(KINDS) + " |\n|---|" + "---|" * len(KINDS))
    for index, case in enumerate(CASES):
        torch.manual_seed(0)
        case.build(root / f"{index}-parts").save_pretrained(root / str(index))
        row = reach(root / str(index), case, root / "offload")
        cells = [cell.component or f"not reachable: {cell.why}" for cell in row.values()]
        print(f"| {case.name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":  # pragma: no cover
    import os
    import sys

    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parents[2]), str(here)]
    sys.path.append(str(here.parents[1]))  # same_output; after the checkout, whose `pipelines` it would shadow
    os.environ.setdefault("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    main()
