"""Replication: each rank's newest snapshot streams to a keeper elsewhere, off the step.

A :class:`Sender` (one thread, one connection) streams the newest snapshot of each local rank to
a :class:`Keeper` (a ROUTER thread) on the next node, or in the buddy rank's process, which holds
the newest replica of each and serves it back (:func:`fetch_replica`). The modules, one job each:

- :mod:`~mindft.replica.wire`: the push protocol's frames and header, endpoints, one-request
  push and fetch;
- :mod:`~mindft.replica.sources`: the snapshots a sender reads and a keeper points into;
- :mod:`~mindft.replica.keeper`: the keeper;
- :mod:`~mindft.replica.spill`: a held replica moving to disk while the next arrives;
- :mod:`~mindft.replica.sender`: the sender;
- :mod:`~mindft.replica.node`: a rank's own replication (:class:`RankReplication`) and a node
  agent's (:class:`NodeReplication`).

Data-parallel ranks hold the same weights and optimizer state after every step (the all-reduce
gives each the same gradients), as MindIO TFT and torchft use when they recover a rank from a
live replica: a keeper asks only for the arrays that differ from its own ranks' snapshot of the
same step and points into that snapshot for the rest, so a replica of a data-parallel rank costs
its small differences, not a state. The pointer is as good as the copy: a replica of step ``s``
restores a lost node only together with the other ranks' snapshots of ``s``.

When a replica counts as fallen behind (LOST PROTECTION) is the flow's rule
(:mod:`mindft.flow.replicas`), reported to the controller (:class:`~mindft.protocol.ReplicaReport`,
shown by ``mindft status``).
"""
from __future__ import annotations

from mindft.replica.keeper import Keeper
from mindft.replica.node import NodeReplication, RankReplication
from mindft.replica.sender import Sender
from mindft.replica.sources import slot_files, store_slots
from mindft.replica.spill import in_memory_filesystem, replica_spill
from mindft.replica.wire import ReplicaHeader, fetch_replica, push_replica

__all__ = [
    "Keeper",
    "NodeReplication",
    "RankReplication",
    "ReplicaHeader",
    "Sender",
    "fetch_replica",
    "in_memory_filesystem",
    "push_replica",
    "replica_spill",
    "slot_files",
    "store_slots",
]
