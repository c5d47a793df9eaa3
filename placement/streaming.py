"""What block-level offloading streams: one definition shared by the runtime (`hooks.group_offload`) and the
planner (`streaming_working_set`), so they never disagree (here because `hooks` may import `placement`).

A block list is an `nn.ModuleList` / `nn.Sequential` found at any depth (T5's `encoder.block`); its children are
the blocks, moved one at a time and never looked into. Everything else is the "rest", resident while the module runs.

A unit is moved by hooks on the module it names, so it must be a module that is called: a child without a forward
of its own (a bare `nn.Module()` stage holding `block` and `upsample`, as the LDM-style VAEs of LTX-2's audio and
others build, whose parent calls `self.up[i].block[j]`) is never called, and stands for its called parts instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .cost import working_set
from .sizing import ComponentSize

BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True, kw_only=True)
class BlockList:
    """One ModuleList/Sequential whose children are streamed one block at a time."""

    path: str  # its qualified name under the root ("" when the root itself is the list)
    container: nn.Module

    @property
    def blocks(self) -> list[tuple[str, nn.Module]]:
        """(qualified path, block) for each child, in order (a child that is never called: its called parts)."""
        return [part for name, block in self.container.named_children()
                for part in called_parts(f"{self.path}.{name}" if self.path else name, block)]


def never_called(module: nn.Module) -> bool:
    """Whether `module` has no forward of its own (`nn.Module()`, `nn.ModuleList`, `nn.ModuleDict`): its parent
    calls its children directly, so a hook on it never fires."""
    return type(module).forward is nn.Module.forward


def _holds_tensors(module: nn.Module) -> bool:
    return bool(module._parameters) or bool(module._buffers)


def called_parts(path: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of `module`, or where it is never called, of its called descendants (the modules a hook
    fires on; none for an empty one); a container holding tensors of its own stays whole (no part carries them)."""
    if not never_called(module) or _holds_tensors(module):
        return [(path, module)]
    return [part for name, child in module.named_children() for part in called_parts(f"{path}.{name}", child)]


@dataclass(frozen=True, kw_only=True)
class BlockLayout:
    """How block-level offloading cuts a module: its block lists, and the modules that hold the rest."""

    block_lists: tuple[BlockList, ...]  # in module order
    # (path, module): the root, the modules descended through, and every other child met on the way; the
    # runtime hooks these so the rest is on the device whenever any of them runs.
    rest_modules: tuple[tuple[str, nn.Module], ...]

    @property
    def block_paths(self) -> list[str]:
        return [path for block_list in self.block_lists for path, _ in block_list.blocks]


def block_groups(module: nn.Module) -> BlockLayout:
    """The block lists of `module` at any depth, and the modules holding everything else (see the module doc)."""
    if isinstance(module, BLOCK_CONTAINERS):
        return BlockLayout(block_lists=(BlockList(path="", container=module),), rest_modules=(("", module),))
    block_lists: list[BlockList] = []
    rest: list[tuple[str, nn.Module]] = [("", module)]
    _descend(module, "", block_lists, rest)
    return BlockLayout(block_lists=tuple(block_lists), rest_modules=tuple(rest))


def _descend(module: nn.Module, prefix: str, block_lists: list[BlockList], rest: list) -> None:
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, BLOCK_CONTAINERS):
            block_lists.append(BlockList(path=path, container=child))
            continue
        found: list[BlockList] = []
        below: list[tuple[str, nn.Module]] = []
        _descend(child, path, found, below)
        rest.append((path, child))
        if found:  # a container of block lists: its blocks stream, its other children join the rest
            block_lists += found
            rest += below


@dataclass(frozen=True, kw_only=True)
class TransferUnit:
    """One piece the transfer planner keeps resident, loads per call or streams: a block, or a piece of the rest
    (`path`: a device-map key relative to the component)."""

    path: str
    bytes: int
    block: bool  # a streamable block; False: part of the rest (on the device for the whole run, never streamed)


def transfer_units(module: nn.Module, size: ComponentSize) -> tuple[TransferUnit, ...]:
    """The rest's pieces (in module order), then every block in execution order, covering every tensor of
    `module` once; a tied tensor shared by two pieces is charged less to the rest's largest, so the units sum to
    `size.total`. Pieces without tensors are left out."""
    layout = block_groups(module)
    rest: list[TransferUnit] = []
    _rest_pieces(module, "", size.module_sizes, rest)
    blocks = [TransferUnit(path=path, bytes=size.module_sizes[path], block=True)
              for path in layout.block_paths if size.module_sizes.get(path, 0) > 0]  # no tensors: nothing moves
    excess = sum(unit.bytes for unit in (*rest, *blocks)) - size.total
    if excess > 0 and rest:  # a tensor tied across two pieces (an embedding and a head) is counted twice above
        largest = max(range(len(rest)), key=lambda i: rest[i].bytes)
        rest[largest] = TransferUnit(path=rest[largest].path, bytes=max(rest[largest].bytes - excess, 0), block=False)
    return (*rest, *blocks)


def _rest_pieces(module: nn.Module, prefix: str, sizes, out: list[TransferUnit]) -> None:
    if isinstance(module, BLOCK_CONTAINERS):
        return  # a block list: its children are blocks
    for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        path = f"{prefix}.{name}" if prefix else name
        if path in sizes:
            out.append(TransferUnit(path=path, bytes=sizes[path], block=False))
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, BLOCK_CONTAINERS):
            continue
        if _holds_block_list(child) or called_parts(path, child) != [(path, child)]:  # its parts move, not it
            _rest_pieces(child, path, sizes, out)
        elif sizes.get(path, 0) > 0:
            out.append(TransferUnit(path=path, bytes=sizes[path], block=False))


def _holds_block_list(module: nn.Module) -> bool:
    return any(isinstance(child, BLOCK_CONTAINERS) for child in module.modules() if child is not module)


def streaming_working_set(module: nn.Module, size: ComponentSize) -> int:
    """Bytes an offloaded component keeps on its execution device at once: the rest plus the blocks in flight
    (`cost.working_set`); all of it for a module with no block list."""
    blocks = [size.module_sizes.get(path, 0) for path in block_groups(module).block_paths]
    return working_set(max(size.total - sum(blocks), 0), blocks)
