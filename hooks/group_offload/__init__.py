"""Group offloading (`offload`) and the streaming engine under it and per-call residency (`module_group`)."""

from .offload import (GroupMemberHook, GroupOffloadHook, GroupOffloadingConfig, GroupOffloadSession, OffloadType,
                      apply_group_offloading, group_offloading_session, remove_group_offloading)

__all__ = ["GroupMemberHook", "GroupOffloadHook", "GroupOffloadingConfig", "GroupOffloadSession", "OffloadType",
           "apply_group_offloading", "group_offloading_session", "remove_group_offloading"]
