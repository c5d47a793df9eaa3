"""Replicas of a placed pipeline over GPU groups and nodes, under `torchrun` (see `replica.load_replica`)."""

from ..errors import ReplicaLoadError
from .replica import Launch, Replica, load_replica

__all__ = ["Launch", "Replica", "ReplicaLoadError", "load_replica"]
