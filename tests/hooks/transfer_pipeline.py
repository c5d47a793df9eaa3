"""A tiny three-component pipeline and hand-built plans with transfer models, for the runtime's tests.

encoder (runs once) -> denoiser (a ModuleList of blocks, runs STEPS times) -> decoder (entered through
`decode`, once), fp32. `component(...)` builds a `ComponentPlan` whose byte counts (placed, resident, per call,
streamed) are read from the module itself, as a planner would fill them.
"""

from __future__ import annotations

import torch
from torch import nn

from placement.device_maps import owning_key, tensor_devices
from placement.devices import is_accelerator, torch_device
from placement.plan_schema import ComponentPlan, ComponentTransfer, DevicePlan, PlacementKind, Plan
from same_output import assert_same_output

STEPS = 4


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.norm(h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Linear(16, 16)

    def forward(self, x, cond):
        return x + torch.tanh(self.attn(x) + self.mlp(cond))


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.norm = nn.LayerNorm(16)
        self.proj_out = nn.Linear(16, 16)

    def forward(self, latents, cond):
        h = self.proj_in(latents)
        for block in self.blocks:
            h = block(h, cond)
        return self.proj_out(self.norm(h))


class Decoder(nn.Module):
    """Entered through `decode`, like a VAE."""

    def __init__(self):
        super().__init__()
        self.post = nn.Linear(16, 16)
        self.up = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 3)

    def decode(self, z):
        h = torch.relu(self.post(z))
        for layer in self.up:
            h = h + torch.tanh(layer(h))
        return self.out(h)

    def forward(self, z):
        return self.decode(z)


def make() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"encoder": Encoder().eval(), "denoiser": Denoiser().eval(), "decoder": Decoder().eval()}


def caller_inputs(device=None) -> torch.Tensor:
    return torch.linspace(-1, 1, 12, device=device).reshape(2, 6)


def run(modules, steps: int = STEPS, *, device=None) -> torch.Tensor:
    """One pipeline call by a caller whose tensors are on `device` (None: the CPU). A caller on the host relies
    on each component handing its outputs back where its inputs came from (what `apply_plan` and dispatch do);
    model and group offloading leave them on the execution device, as diffusers' do, so their caller works
    there, as a diffusers pipeline does on its `_execution_device`."""
    with torch.no_grad():
        cond = modules["encoder"](caller_inputs(device))
        latents = torch.zeros(2, 16, device=device)
        for _ in range(steps):
            latents = latents + 0.5 * modules["denoiser"](latents, cond)
        return modules["decoder"].decode(latents)


def assert_decoded(output: torch.Tensor, expected: torch.Tensor, *, on=0) -> None:
    """The call computed `expected` (a plain CPU run's result), and handed it over where the decoder executed,
    accelerator `on`: `decode` is entered past the top hook, and like accelerate's hooks ours move its inputs
    only; the caller moves the image (a diffusers pipeline's postprocessing calls `.cpu()`)."""
    assert output.device == torch_device(on)
    assert_same_output(output, expected)


def place_resident(modules, placement: Plan) -> None:
    """The loader's part: every device-map entry naming an accelerator gets its weights there (the runtime
    leaves resident weights where the loader put them)."""
    for name, planned in placement.components.items():
        place_entries(modules[name], planned.device_map)


def place_entries(module: nn.Module, device_map: dict) -> None:
    """The loader's part for one module: the weights of the entries naming an accelerator moved there."""
    for key, device in device_map.items():
        if is_accelerator(device):
            module.get_submodule(key).to(torch_device(device))


def nbytes(module: nn.Module, paths=("",)) -> int:
    """Bytes of the tensors of `module` under `paths` ("" = all)."""
    return sum(t.numel() * t.element_size() for name, t in module.state_dict().items()
               if any(owning_key(name, [path]) is not None for path in paths))


def component(name: str, module: nn.Module, device_map: dict, *, execution=0, per_call=(), streamed=(),
              runs: int = 1, kind: PlacementKind | None = None, activation_bytes: int | None = None,
              transfer: bool = True) -> ComponentPlan:
    """The ComponentPlan of `module` placed by `device_map`, with its transfer model filled from the module."""
    homes = tensor_devices(module, device_map)
    sizes = {name: t.numel() * t.element_size() for name, t in module.state_dict().items()}
    placed: dict = {}
    for tensor, home in homes.items():
        placed[home] = placed.get(home, 0) + sizes[tensor]
    if kind is None:
        kind = PlacementKind.WHOLE if set(placed) == {execution} else PlacementKind.OFFLOADED
    resident = sum(size for device, size in placed.items() if is_accelerator(device))
    plan_transfer = ComponentTransfer(
        runs_per_call=runs, resident_bytes=resident, loaded_per_call_bytes=nbytes(module, per_call),
        streamed_per_run_bytes=nbytes(module, streamed), per_call_modules=list(per_call),
        streamed_modules=list(streamed)) if transfer else None
    return ComponentPlan(name=name, kind=kind, devices=sorted(placed, key=str), execution_device=execution,
                         bytes=sum(sizes.values()), device_map=device_map, placed_bytes=placed,
                         activation_bytes=activation_bytes, transfer=plan_transfer)


def plan(components: list[ComponentPlan], budgets: dict) -> Plan:
    """A Plan of `components` (in execution order) with these accelerator budgets (overhead 0)."""
    devices = []
    for device, budget in budgets.items():
        weights = sum(c.placed_bytes.get(device, 0) for c in components)
        devices.append(DevicePlan(device=device, budget=budget, weight_bytes=weights, activation_peak=0,
                                  overhead=0, predicted_peak=weights, left=budget - weights))
    return Plan(strategy="balanced", components={c.name: c for c in components}, devices=devices,
                crossing_edges=[], fallbacks=[], activations_accounted=False, warnings=[])
