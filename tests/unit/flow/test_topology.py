"""The buddy topology: which node keeps whose replicas, which rank is a rank's buddy, and where
the keeper of a node's replicas listens, as tables."""
from __future__ import annotations

import pytest

from mindft.flow.topology import Topology, rank_buddy

THREE_NODES = Topology(nproc=2, nnodes=3)


def test_ranks_are_laid_out_node_by_node() -> None:
    assert THREE_NODES.world_size == 6
    assert [list(THREE_NODES.ranks_of(node)) for node in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [THREE_NODES.node_of(rank) for rank in range(6)] == [0, 0, 1, 1, 2, 2]


def test_each_node_keeps_the_previous_nodes_replicas_round_the_ring() -> None:
    assert [THREE_NODES.buddy_node(node) for node in range(3)] == [1, 2, 0]
    assert [THREE_NODES.kept_node(node) for node in range(3)] == [2, 0, 1]
    for node in range(3):
        assert THREE_NODES.kept_node(THREE_NODES.buddy_node(node)) == node
    two = Topology(nproc=4, nnodes=2)
    assert (two.buddy_node(0), two.buddy_node(1), two.kept_node(0), two.kept_node(1)) == (1, 0, 1, 0)


@pytest.mark.parametrize("topology, buddies", [
    (Topology(nproc=2, nnodes=3), [2, 3, 4, 5, 0, 1]),  # the same local rank on the next node
    (Topology(nproc=1, nnodes=2), [1, 0]),
    (Topology(nproc=4, nnodes=1), [None, None, None, None]),  # one node: the agent's memory holds the state
])
def test_a_ranks_buddy_is_its_local_rank_on_the_next_node(topology: Topology, buddies: list) -> None:
    assert [topology.buddy_rank(rank) for rank in range(topology.world_size)] == buddies
    for rank, buddy in enumerate(buddies):
        if buddy is not None:
            assert topology.node_of(buddy) == topology.buddy_node(topology.node_of(rank))


def test_the_keeper_of_a_nodes_replicas_is_found_on_the_next_node() -> None:
    endpoints = {0: "tcp://10.0.0.1:5000", 1: "tcp://10.0.0.1:5000", 3: "tcp://10.0.0.2:5001",
                 2: "tcp://10.0.0.2:5000", 4: "", 5: "inproc://rank5"}
    assert THREE_NODES.keeper_endpoint(0, endpoints) == "tcp://10.0.0.2:5000"  # node 1's lowest rank first
    assert THREE_NODES.keeper_endpoint(2, endpoints) == "tcp://10.0.0.1:5000"  # round the ring to node 0
    assert THREE_NODES.keeper_endpoint(1, endpoints) == ""  # node 2 announced no TCP keeper
    assert THREE_NODES.keeper_endpoint(1, {}) == ""


@pytest.mark.parametrize("rank, world, configured, buddy", [
    (0, 4, None, 1), (3, 4, None, 0),  # without mindft-launch: the next rank
    (1, 4, 3, 3),                      # MINDFT_REPLICA_BUDDY names it
    (1, 4, -1, None),                  # -1: the node agent holds the state
    (0, 1, None, None), (0, 1, 0, None),  # alone
])
def test_a_rank_without_nodes_replicates_to_the_configured_or_next_rank(rank: int, world: int,
                                                                       configured: int, buddy: int) -> None:
    assert rank_buddy(rank, world, configured) == buddy
