"""Guidance branches in parallel: a denoiser placed whole on one GPU gets a replica on a second GPU, and its
`forward` sends one guidance branch there while the other runs at home (`placement.guidance`).

- A batch of two (the branches concatenated) is cut into its halves: the first half runs at home on this thread,
  the second on the replica on a worker thread, at once; the replica's outputs are gathered on the execution device
  and concatenated after the home ones, so the pipeline gets the batch it passed, in its order.
- Two calls per step: the first goes to the replica on the worker thread and returns at once (`LazyOutput`); the
  second runs at home while the first computes; the first's output is gathered when the pipeline uses it.

Each copy between the GPUs is counted by the transfer meter; `trace_calls()` shows both GPUs computing. The replica
holds its own weights (the plan charged its GPU for them); an edit of the module's weights (adapters, through
`hooks.edit_placed_weights`) rebuilds it, and a change of the module's parameters made otherwise is seen at the
next call. The replica is no submodule: `state_dict()` and saves see one copy. `remove_guidance_parallel` (and
`undispatch`, `reset_device_map()`) frees it.

    handle = apply_guidance_parallel(pipe.transformer, GuidanceParallelConfig(...))
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.hooks import remove_hook_from_module
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from placement.devices import Device, torch_device
from placement.drawings import COMPUTE_END, COMPUTE_START
from placement.guidance import GuidanceMode

from . import trace
from .errors import PlacementRuntimeError
from .hook_utils import hooks_of
from .input_moving import MoveInputsHook, first_tensor, move_to_device, remove_glue, restore_entry_methods
from .transfer_meter import place_of_device
from .lazy_output import LazyOutput, resolved
from .run_timing import remove_run_timing

_ATTRIBUTE = "forward"  # the instance attribute the branching forward takes (the module's own stays the class's)
# The traced blocks of the two branches: named apart from the component's own run (block ""), which a placed run's
# timing (`hooks.run_timing`) counts once per run.
HOME_BRANCH, REPLICA_BRANCH = "guidance branch (home)", "guidance branch (replica)"


@dataclass(frozen=True, kw_only=True)
class GuidanceParallelConfig:
    """The component (for traces and errors), how its call runs guidance, where it executes, its replica's GPU."""

    component: str
    mode: GuidanceMode
    execution_device: Device
    replica_device: Device


@dataclass(frozen=True, kw_only=True, eq=False)
class GuidanceParallelHandle:
    module: nn.Module
    config: GuidanceParallelConfig

    def remove(self) -> None:
        remove_guidance_parallel(self.module)

    @property
    def replica(self) -> nn.Module:
        return branching(self.module).replica


def apply_guidance_parallel(module: nn.Module, config: GuidanceParallelConfig) -> GuidanceParallelHandle:
    """Give `module` (placed, on `config.execution_device`) a replica on `config.replica_device` and the branching
    forward; applied after the module's placement hooks, removed before them."""
    if config.mode is GuidanceMode.NONE:
        raise PlacementRuntimeError(f"{config.component}: guidance in parallel needs a batch of two or two calls per "
                                    "step; its call runs neither (the plan did not choose it).")
    if branching(module) is not None:
        remove_guidance_parallel(module)
    vars(module)[_ATTRIBUTE] = BranchingForward(module, config)
    return GuidanceParallelHandle(module=module, config=config)


def remove_guidance_parallel(module: nn.Module) -> None:
    """Put back the forward `module` had and free its replica (nothing to do where it has none)."""
    found = branching(module)
    if found is None:
        return
    found.close()
    if found.inner_is_attribute:
        vars(module)[_ATTRIBUTE] = found.inner
    else:
        vars(module).pop(_ATTRIBUTE, None)


def branching(module: nn.Module) -> "BranchingForward | None":
    found = vars(module).get(_ATTRIBUTE)
    return found if isinstance(found, BranchingForward) else None


class BranchingForward:
    """`module.forward` while its guidance branches run on two GPUs."""

    def __init__(self, module: nn.Module, config: GuidanceParallelConfig) -> None:
        self.config = config
        self.inner_is_attribute = _ATTRIBUTE in vars(module)  # accelerate's hook wrapper, usually
        self.inner = module.forward
        self.home, self.away = torch_device(config.execution_device), torch_device(config.replica_device)
        self._module = module
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{config.component}-replica")
        self._pending: _Pending | None = None
        self._cannot_halve = False
        self._lock = threading.Lock()
        self.replica, self._parameters = self._built(), _parameter_ids(module)
        trace.label_block(self.replica, trace.BlockLabel(component=config.component, path=REPLICA_BRANCH,
                                                         place=config.replica_device))
        self._home_label = trace.BlockLabel(component=config.component, path=HOME_BRANCH,
                                            place=config.execution_device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._settle()
        if _parameter_ids(self._module) != self._parameters:  # changed outside an edit: followed now
            self.rebuild()
        if self.config.mode is GuidanceMode.BATCH_OF_TWO:
            return self._halves(args, kwargs)
        return self._alternating(args, kwargs)

    # --- a batch of two: the halves at once ---------------------------------------------------------------------
    def _halves(self, args: tuple, kwargs: dict) -> Any:
        halves = None if self._cannot_halve else _halved((args, kwargs))
        if halves is None:  # an odd batch, or no batch: nothing to cut
            return self.inner(*args, **kwargs)
        try:
            return self._at_once(*halves)
        except RuntimeError as error:  # a model whose batch does not cut along its first input's leading size
            self._cannot_halve = True
            warnings.warn(
                f"{self.config.component}: its batch of two could not run as two halves ({error}); it runs whole on "
                f"its execution device from now on. Load with guidance_parallel=False to free the replica's GPU.",
                RuntimeWarning, stacklevel=2)
            return self.inner(*args, **kwargs)

    def _at_once(self, home: tuple, away: tuple) -> Any:
        (home_args, home_kwargs), (away_args, away_kwargs) = home, away
        away = self._submit(away_args, away_kwargs)
        try:
            near = self._at_home(home_args, home_kwargs)
        finally:
            far = away.result()
        first = first_tensor(near)
        return _concatenated(near, self._gathered(far, self.home if first is None else first.device))

    # --- two calls per step: the first on the replica, returned at once -----------------------------------------
    def _alternating(self, args: tuple, kwargs: dict) -> Any:
        args, kwargs = resolved((args, kwargs))
        pending = self._pending
        if pending is None:
            target = self._output_device(args, kwargs)
            future = self._submit(args, kwargs)
            pending = self._pending = _Pending(future=future)

            def gathered(output: Any) -> Any:
                pending.used = True  # the pipeline used it before calling again: no partner in this step
                return self._gathered(output, target)

            return LazyOutput(future, gathered)
        pending.paired = True  # this call is the first one's partner: it runs at home while the first computes
        return self._at_home(args, kwargs)

    def _at_home(self, args: tuple, kwargs: dict) -> Any:
        """The home branch, marked in a trace as computing on the execution device (the module's own call is not:
        it only hands the other branch to the replica)."""
        recording = trace.active_trace()
        if recording is not None:
            recording.record(COMPUTE_START, self._home_label, device=self.home)
        try:
            return self.inner(*args, **kwargs)
        finally:
            if recording is not None:
                recording.record(COMPUTE_END, self._home_label, device=self.home)

    def _settle(self) -> None:
        """A branch whose partner already ran, or whose output the pipeline used, is done with: waited for before
        another starts (one replica run at a time). One merely finished is not: its partner may still come."""
        pending = self._pending
        if pending is not None and (pending.paired or pending.used):
            pending.future.result()
            self._pending = None

    # --- the replica ----------------------------------------------------------------------------------------------
    def _submit(self, args: tuple, kwargs: dict) -> Future:
        # Fresh containers: `move_to_device` updates lists and dicts in place, and these are the pipeline's.
        leaves, spec = tree_flatten((args, kwargs))
        moved = move_to_device(tree_unflatten(leaves, spec), self.away, self.config.replica_device)
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        return self._pool.submit(self._run_replica, moved, grad, inference)

    def _run_replica(self, moved: tuple, grad: bool, inference: bool) -> Any:
        args, kwargs = moved
        # The caller's grad and inference modes are per thread: the pipeline's `no_grad` holds here too.
        with torch.inference_mode(inference), torch.set_grad_enabled(grad), _on_device(self.away):
            return self.replica(*args, **kwargs)

    def _gathered(self, output: Any, device: torch.device) -> Any:
        """The replica's outputs where the module's own would be (counted as moved from the replica's GPU)."""
        return move_to_device(output, device, place_of_device(device))

    def _output_device(self, args: tuple, kwargs: dict) -> torch.device:
        """Where the module's own call leaves its outputs: the caller's device where its input-moving hook moves
        them back (`io_same_device`), else the execution device."""
        hook = next((hook for hook in hooks_of(self._module) if isinstance(hook, MoveInputsHook)), None)
        first = first_tensor([args, kwargs]) if hook is not None and hook.io_same_device else None
        return self.home if first is None else first.device

    def _built(self) -> nn.Module:
        """A copy of the module's structure holding copies of its tensors on the replica's GPU (read from where
        they are: the module's GPU does not hold a second copy at any time), without the placement's hooks."""
        memo: dict[int, Any] = {}
        for tensor in [*self._module.parameters(), *self._module.buffers()]:
            if id(tensor) not in memo:
                moved = tensor.detach().to(self.away)
                memo[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if isinstance(
                    tensor, nn.Parameter) else moved
        own = vars(self._module).pop(_ATTRIBUTE, None)  # this object is no part of the copy
        try:
            replica = copy.deepcopy(self._module, memo)
        finally:
            if own is not None:
                vars(self._module)[_ATTRIBUTE] = own
        _without_placement_hooks(replica)
        return replica.eval() if not self._module.training else replica

    def rebuild(self) -> None:
        """A fresh replica of the module as it is now (after an edit of its weights or adapters)."""
        with self._lock:
            self._settle()
            if self._pending is not None:
                self._pending.future.result()
                self._pending = None
            self.replica, self._parameters = self._built(), _parameter_ids(self._module)
            trace.label_block(self.replica, trace.BlockLabel(component=self.config.component, path=REPLICA_BRANCH,
                                                             place=self.config.replica_device))

    def close(self) -> None:
        if self._pending is not None:
            self._pending.future.result()
            self._pending = None
        self._pool.shutdown(wait=True)
        self.replica = None


@dataclass(kw_only=True)
class _Pending:
    future: Future
    paired: bool = False  # its partner call ran at home
    used: bool = False  # the pipeline used its output


class ReplicaEditor:
    """`hooks.edit_placed_weights`' editor for a module with a replica: the replica is rebuilt once the edit is
    done, so both GPUs compute with the edited weights."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def open(self) -> None:
        pass

    def close(self) -> list[str]:
        found = branching(self.module)
        if found is not None:
            found.rebuild()
        return []

    def homes(self) -> dict[str, Device]:
        return {}


def _without_placement_hooks(replica: nn.Module) -> None:
    """The copy runs where its tensors are, called by the branching forward: the placement's hooks, glue and
    timing it copied from the module are removed (its weights are all on the replica's GPU: nothing to serve)."""
    remove_run_timing(replica)
    remove_hook_from_module(replica, recurse=True)
    remove_glue(replica)
    restore_entry_methods(replica)
    if "hf_device_map" in vars(replica):
        del replica.hf_device_map


def _parameter_ids(module: nn.Module) -> tuple[int, ...]:
    return tuple(id(parameter) for parameter in module.parameters())


def _batch(leaves: list) -> int | None:
    """The batch: the leading size of the first floating tensor (the latents, as call capture reads it)."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def _halved(inputs: Any) -> tuple[Any, Any] | None:
    """The inputs cut in two along the batch: every tensor of the batch's leading size, halved; the rest shared."""
    leaves, spec = tree_flatten(inputs)
    batch = _batch(leaves)
    if batch is None or batch < 2 or batch % 2:
        return None
    half = batch // 2

    def cut(part: int) -> Any:
        return tree_unflatten([leaf[part * half:(part + 1) * half] if _batched(leaf, batch) else leaf
                               for leaf in leaves], spec)

    return cut(0), cut(1)


def _batched(leaf: Any, batch: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == batch


def _concatenated(near: Any, far: Any) -> Any:
    """The two halves' outputs as one batch: tensors concatenated along it, anything else the home half's."""
    near_leaves, spec = tree_flatten(near)
    far_leaves, _ = tree_flatten(far)
    if len(near_leaves) != len(far_leaves):
        raise PlacementRuntimeError(f"The two halves of a batch of two returned different structures ({spec}); "
                                    "run this component without guidance_parallel.")
    joined = [torch.cat([a, b]) if isinstance(a, torch.Tensor) and a.dim() >= 1 else a
              for a, b in zip(near_leaves, far_leaves)]
    return tree_unflatten(joined, spec)


def _on_device(device: torch.device):
    """CUDA launches from the worker thread on the replica's GPU (elsewhere each tensor says its device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


__all__ = ["BranchingForward", "GuidanceParallelConfig", "GuidanceParallelHandle", "ReplicaEditor",
           "apply_guidance_parallel", "branching", "remove_guidance_parallel"]
