"""Group offloading: weights kept in CPU RAM or on disk, moved to the execution device a group of modules (a
block, or a leaf) at a time, with prefetch on a side CUDA stream.

offload.py   the technique: config, session, hooks, apply/remove, its technique-table row
module_group.py  the streaming engine (also under per-call residency): which modules form a group (block
                 lists at any depth, or each leaf), one group's tensors moving together, regrouping after edits
storage.py, transfer.py   where a group's tensors rest, how they move
"""

from .offload import (
    GroupMemberHook,
    GroupOffloadHook,
    GroupOffloadingConfig,
    GroupOffloadSession,
    OffloadType,
    apply_group_offloading,
    group_offloading_session,
    remove_group_offloading,
)

__all__ = [
    "GroupMemberHook",
    "GroupOffloadHook",
    "GroupOffloadingConfig",
    "GroupOffloadSession",
    "OffloadType",
    "apply_group_offloading",
    "group_offloading_session",
    "remove_group_offloading",
]
