"""What block-level offloading streams: ONE definition shared by the runtime and the planner.

`hooks.group_offload.module_group.plan_groups` builds its offload groups from `block_groups(module)`, and the planner's
`streaming_working_set` (what an offloaded component keeps on its execution device at once) reads the same
layout, so the plan and the runtime never disagree on which bytes stream. (It lives here because `hooks`
may import `placement`, never the reverse.)

A block list is an `nn.ModuleList` / `nn.Sequential`; its children are the blocks, moved to the device one
at a time. Block lists are found at any depth: a child that is not a block list itself but holds one further
down (a transformers `T5EncoderModel` keeps its blocks under `encoder.block`, a CLIP text model under
`text_model.encoder.layers`, a VAE under `encoder.down_blocks`) is descended into. Everything outside the
blocks -- the root's own tensors, the tensors of the modules descended through, and every child that holds
no block list (embeddings, norms, heads) -- is the "rest", resident while any part of the module runs.
Blocks are never looked into: a block's own lists move with it.
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
        """(qualified path, block) for each child, in order."""
        return [(f"{self.path}.{name}" if self.path else name, block) for name, block in self.container.named_children()]


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
    """One piece the transfer planner keeps resident, loads per call or streams: a block, or a piece of the rest.

    `path` is a device-map key relative to the component (a module path, or a tensor path for a tensor held
    directly by a module the layout descends through)."""

    path: str
    bytes: int
    block: bool  # a streamable block; False: part of the rest (on the device for the whole run, never streamed)


def transfer_units(module: nn.Module, size: ComponentSize) -> tuple[TransferUnit, ...]:
    """The rest's pieces (in module order), then every block in execution order: together they cover every
    tensor of `module` once, so a device map over their paths places all of it.

    The rest's pieces are the tensors held directly by the root and by the modules descended through, and
    every other child that holds no block list (whole). Pieces without tensors are left out. Tied tensors are
    counted once (where `size` counts them): when two pieces share one, the rest's largest piece is charged
    less, so that the units always sum to `size.total`. Blocks without tensors are left out too."""
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
        if _holds_block_list(child):
            _rest_pieces(child, path, sizes, out)
        elif sizes.get(path, 0) > 0:
            out.append(TransferUnit(path=path, bytes=sizes[path], block=False))


def _holds_block_list(module: nn.Module) -> bool:
    return any(isinstance(child, BLOCK_CONTAINERS) for child in module.modules() if child is not module)


def streaming_working_set(module: nn.Module, size: ComponentSize) -> int:
    """Bytes an offloaded component keeps on its execution device at once while it runs.

    The rest stays on the device for the whole forward and the blocks move one at a time with the next one
    prefetched, so the working set is the rest plus the blocks in flight (`cost.working_set`). A module with
    no block list streams nothing: its working set is all of it, and offloading it saves no accelerator
    memory. Tied tensors are counted once, where `size` counts them (their first name).
    """
    blocks = [size.module_sizes.get(path, 0) for path in block_groups(module).block_paths]
    return working_set(max(size.total - sum(blocks), 0), blocks)
