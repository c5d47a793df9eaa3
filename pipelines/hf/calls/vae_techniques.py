"""VAE tiling and slicing as planned memory techniques: which VAEs offer them, and the activation estimate of a VAE
call with them on. The VAE's own tiled code runs on fake tensors, with each repeated tile shape replayed (same
transient peak, empty outputs) and diffusers' in-place row blends skipped, so a video VAE of hundreds of tiles
estimates in seconds with the peak a full run gives."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from placement.activations.tracking import LiveStorageTracker
from placement.plan_schema import MemoryTechnique

# The VAE flag each technique sets, and its switches (diffusers' names, and ours): "use_tiling", "enable_tiling", ...
_FLAGS, _ENABLE, _DISABLE = ({t: f"{verb}_{t.value.removeprefix('vae_')}" for t in MemoryTechnique}
                             for verb in ("use", "enable", "disable"))
# Submodules a tiled or sliced call runs once per tile or sample: replayed by shape.
_REPEATED_PARTS = ("decoder", "encoder")
# diffusers' in-place blends of two tiles' overlap: `blend_x(a, b, extent)` writes into `b` and returns it.
_BLENDS = ("blend_v", "blend_h", "blend_t")
# Square tile sizes in pixels, as AutoencoderKL and ours name them (the video VAEs and DC-AE set a height and a
# width, `tile_sample_min_height`/`_width`, and HunyuanVideo frames too).
_SQUARE_TILE_ATTRIBUTES = ("tile_sample_min_size", "tile_sample_size")


class EstimableCall(Protocol):
    """What `ExampleCall` and our pipelines' `ComponentCall` share: a method name and an estimate."""

    method: str

    def estimate(self, module: nn.Module, *, dtype: torch.dtype | None = None) -> int: ...


def supported_techniques(module: nn.Module) -> tuple[MemoryTechnique, ...]:
    """The techniques `module` offers: its flag attribute and its enable method (diffusers VAEs and ours)."""
    return tuple(technique for technique in MemoryTechnique
                 if hasattr(module, _FLAGS[technique]) and callable(getattr(module, _ENABLE[technique], None)))


def is_on(module: nn.Module, technique: MemoryTechnique) -> bool:
    """Whether the module has the technique on already (a component passed in, set up by its user)."""
    return getattr(module, _FLAGS[technique], False) is True


def enable_techniques(module: nn.Module, techniques) -> tuple[str, ...]:
    """Turn the planned techniques on; the names of the methods that turn off those that were off (for a reset)."""
    undo = []
    for technique in map(MemoryTechnique, techniques):
        if not is_on(module, technique):
            undo.append(_DISABLE[technique])
        getattr(module, _ENABLE[technique])()
    return tuple(undo)


def tile_description(module: nn.Module) -> str:
    """The VAE's tiles as its class sets them, e.g. "tiles of 256x256 pixels x 16 frames", for reasons."""
    height, width = (getattr(module, f"tile_sample_min_{side}", None) for side in ("height", "width"))
    if not (isinstance(height, int) and isinstance(width, int)):  # square tiles: AutoencoderKL, ours
        height = width = next((getattr(module, name) for name in _SQUARE_TILE_ATTRIBUTES
                               if isinstance(getattr(module, name, None), int)), None)
    if height is None:
        return f"{type(module).__name__}'s default tiles"
    frames = getattr(module, "tile_sample_min_num_frames", None)
    return f"tiles of {height}x{width} pixels" + (f" x {frames} frames" if isinstance(frames, int) else "")


@dataclass(frozen=True, kw_only=True)
class RequiredTechnique:
    """A technique a VAE cannot run the call without: its own code refuses the call with the technique off
    (Allegro's VAE: "Decoding without tiling has not been implemented yet"; diffusers' own tests turn tiling on),
    and runs it with the technique on. The plan turns it on whatever the budget, and says why."""

    technique: MemoryTechnique
    reason: str  # the refusal, for a person: "AutoencoderKLAllegro.decode raises NotImplementedError: ..."


def techniques_to_try(module: nn.Module) -> tuple[MemoryTechnique, ...]:
    """The techniques `module` offers and does not have on, tiling first (it changes the most a call needs)."""
    offered = [technique for technique in supported_techniques(module) if not is_on(module, technique)]
    return tuple(sorted(offered, key=lambda technique: technique is not MemoryTechnique.VAE_TILING))


@dataclass(frozen=True, kw_only=True)
class WithTechniques:
    """`call` estimated with `techniques` turned on in the module for the length of the estimate."""

    call: EstimableCall
    techniques: frozenset[MemoryTechnique] = field(default_factory=frozenset)

    @property
    def method(self) -> str:
        return self.call.method

    def estimate(self, module: nn.Module, *, dtype: torch.dtype | None = None) -> int:
        with techniques_on(module, self.techniques):
            return self.call.estimate(module, dtype=dtype)


@contextmanager
def techniques_on(module: nn.Module, techniques) -> Iterator[None]:
    """The module's technique flags set as `techniques` says (on for those, off for the others it offers; then
    restored), its decoder and encoder replayed by input shape while any is on."""
    flags = {_FLAGS[technique]: technique in techniques for technique in supported_techniques(module)}
    saved = {name: getattr(module, name) for name in flags}
    with ExitStack() as stack:
        for name, value in flags.items():
            setattr(module, name, value)
        stack.callback(lambda: [setattr(module, name, value) for name, value in saved.items()])
        if any(flags.values()):
            for part in _REPEATED_PARTS:
                if isinstance(getattr(module, part, None), nn.Module):
                    stack.enter_context(replayed_by_shape(getattr(module, part)))
            for blend in _BLENDS:
                if callable(getattr(module, blend, None)):
                    stack.enter_context(_skipped_blend(module, blend))
        yield


@contextmanager
def _skipped_blend(module: nn.Module, name: str) -> Iterator[None]:
    """`module.<name>(a, b, extent)` returns `b` as it is: the overlap's values, not its memory (module doc)."""
    setattr(module, name, lambda a, b, *extent: b)
    try:
        yield
    finally:
        delattr(module, name)


@contextmanager
def replayed_by_shape(module: nn.Module) -> Iterator[None]:
    """`module.forward` runs for real once per distinct input shape; repeats are replayed (module doc)."""
    had_own = "forward" in module.__dict__
    original = module.forward
    replays: dict[Any, _Replay] = {}

    def forward(*args, **kwargs):
        key = _shape_key((args, kwargs))
        if key is not None and key in replays:
            return replays[key].run(args, kwargs)
        tracker = LiveStorageTracker()  # entered inside the estimate's own tracker: both count each op
        with tracker:
            output = original(*args, **kwargs)
        replay = _Replay.of(output, args, kwargs, tracker.peak_bytes)
        if key is not None and replay is not None:
            replays[key] = replay
        return output

    module.forward = forward
    try:
        yield
    finally:
        if had_own:
            module.forward = original
        else:
            del module.forward


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _shape_key(tree: Any):
    """Shapes and dtypes of the tensors, values of the plain leaves; None when a leaf is neither (no replay)."""
    leaves, spec = tree_flatten(tree)
    key = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append((tuple(leaf.shape), leaf.dtype))
        elif isinstance(leaf, _PLAIN):
            key.append(leaf)
        else:
            return None
    return (str(spec), tuple(key))


@dataclass(frozen=True, kw_only=True)
class _Shapes:
    """A pytree described by its structure, its tensors' shapes/dtypes/devices and its plain leaves."""

    spec: Any
    leaves: tuple

    @classmethod
    def of(cls, tree: Any) -> "_Shapes | None":
        leaves, spec = tree_flatten(tree)
        if not all(isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in leaves):
            return None  # something we cannot rebuild: the call always runs for real
        return cls(spec=spec, leaves=tuple((True, (tuple(leaf.shape), leaf.dtype, leaf.device))
                                           if isinstance(leaf, torch.Tensor) else (False, leaf) for leaf in leaves))

    def build(self) -> Any:
        """The same structure with new empty tensors of the same shapes (allocated: the tracker counts them)."""
        leaves = [torch.empty(value[0], dtype=value[1], device=value[2]) if is_tensor else value
                  for is_tensor, value in self.leaves]
        return tree_unflatten(leaves, self.spec)


@dataclass(frozen=True, kw_only=True)
class _Replay:
    """What one real call allocated at its peak, its output, and what it left in the lists and dicts it was
    given (a causal VAE's frame cache and conv index): a replay writes the same back."""

    peak_bytes: int
    output: _Shapes
    containers: tuple  # ((position or keyword, _Shapes of the container's contents after the call), ...)

    @classmethod
    def of(cls, output: Any, args: tuple, kwargs: dict, peak_bytes: int) -> "_Replay | None":
        described = _Shapes.of(output)
        containers = []
        for where, value in _containers(args, kwargs):
            after = _Shapes.of(list(value) if isinstance(value, list) else dict(value))
            if after is None:
                return None
            containers.append((where, after))
        return None if described is None else cls(peak_bytes=peak_bytes, output=described,
                                                  containers=tuple(containers))

    def run(self, args: tuple, kwargs: dict) -> Any:
        transient = torch.empty(self.peak_bytes, dtype=torch.uint8, device="meta")
        del transient  # the call's peak, held for an instant, as the real call reached it
        given = dict(_containers(args, kwargs))
        for where, after in self.containers:
            contents, container = after.build(), given[where]
            if isinstance(container, list):
                container[:] = contents
            else:
                container.clear()
                container.update(contents)
        return self.output.build()


def _containers(args: tuple, kwargs: dict):
    """The lists and dicts among a call's arguments (what a forward may write into), by position or keyword."""
    named = [*enumerate(args), *kwargs.items()]
    return [(where, value) for where, value in named if isinstance(value, (list, dict))]
