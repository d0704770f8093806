"""The rank table's incremental bookkeeping: per-state counts and ``alive`` follow every state
assignment and every record replaced, so "has every rank finished" needs no scan."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from mindft.flow import RankRecord, RankState, RankTable


def record(rank: int, incarnation: int = 0, state: RankState = RankState.REGISTERED) -> RankRecord:
    return RankRecord(rank=rank, peer=f"rank{rank}.inc{incarnation}".encode(), incarnation=incarnation, pid=100 + rank,
                      replica_endpoint="", held=(0,), last_seen=0.0, state=state)


def recount(table: RankTable) -> Counter:
    return Counter(r.state for r in table)


def assert_in_sync(table: RankTable) -> None:
    counts = recount(table)
    for state in RankState:
        assert table.count(state) == counts[state], (state, table.count(state), counts[state])
    for r in table:
        assert r.alive == (r.state not in (RankState.DEAD, RankState.OFF_DEVICE, RankState.LOST)), r
    assert table.live() == {r.rank for r in table if r.alive}
    assert table.all_alive == all(r.alive for r in table)
    assert table.peers() == tuple(dict.fromkeys(r.target for r in table if r.alive))


def test_counts_follow_assignments_and_replacements() -> None:
    table = RankTable(3)
    for rank in range(3):
        table.add(record(rank))
    assert table.count(RankState.REGISTERED) == 3 and table.count(RankState.DONE) == 0
    table.get(0).state = RankState.DONE
    table.get(1).state = RankState.DONE
    assert table.count(RankState.DONE) == 2 and table.count(RankState.REGISTERED) == 1
    old = table.get(1)
    table.add(record(1, incarnation=1))  # a restarted rank replaces its record: its DONE is gone
    assert table.count(RankState.DONE) == 1 and table.count(RankState.REGISTERED) == 2
    old.state = RankState.DEAD  # the replaced record no longer counts
    assert table.count(RankState.DEAD) == 0
    assert_in_sync(table)


def test_alive_follows_the_state_from_construction_on() -> None:
    dead = record(0, state=RankState.DEAD)
    assert not dead.alive
    dead.state = RankState.PAUSED
    assert dead.alive
    dead.state = RankState.OFF_DEVICE
    assert not dead.alive
    table = RankTable(1)
    table.add(dead)
    assert table.count(RankState.OFF_DEVICE) == 1 and table.peers() == ()


def test_a_record_belongs_to_one_table() -> None:
    shared = record(0)
    RankTable(1).add(shared)
    with pytest.raises(ValueError, match="already in a table"):
        RankTable(1).add(shared)


def test_counts_match_a_full_recount_after_random_changes() -> None:
    pick = random.Random(14)
    table = RankTable(8)
    incarnations = [0] * 8
    for _ in range(5000):
        rank = pick.randrange(8)
        if table.get(rank) is None or pick.random() < 0.1:
            incarnations[rank] += 1
            table.add(record(rank, incarnations[rank], pick.choice(list(RankState))))
        else:
            table.get(rank).state = pick.choice(list(RankState))
        assert_in_sync(table)


def relayed_table(ranks: int) -> RankTable:
    """``ranks`` RUNNING ranks, all behind one relay (agent/0/1)."""
    table = RankTable(ranks)
    for rank in range(ranks):
        table.add(RankRecord(rank=rank, peer=b"agent/0/1#" + f"rank{rank}.inc0".encode(), incarnation=0, pid=rank,
                             replica_endpoint="", held=(0,), last_seen=0.0, state=RankState.RUNNING))
    return table


def test_a_nodes_acknowledgement_moves_its_live_ranks_in_one_pass_and_names_the_strays() -> None:
    table = relayed_table(4)
    table.get(1).state = RankState.FAULTY
    table.get(2).state = RankState.DEAD
    table.rebind(table.get(3), b"agent/1/1#rank3.inc0")  # now behind another relay
    heard, strays = table.acknowledge(b"agent/0/1#", (0, 1, 2, 3), 5.0, RankState.PAUSED, RankState.FAULTY, (4,), 7)
    assert list(heard) == [0, 1] and strays == [3]
    assert [table.get(r).state for r in range(4)] == [RankState.PAUSED, RankState.FAULTY, RankState.DEAD,
                                                      RankState.RUNNING]
    assert [(table.get(r).held, table.get(r).held_round, table.get(r).last_seen) for r in (0, 1, 2)] == [
        ((4,), 7, 5.0), ((4,), 7, 5.0), ((0,), -1, 0.0)]
    everyone, strays = table.acknowledge(b"agent/0/1#", (0, 1), 6.0, RankState.RESUMED)
    assert everyone == (0, 1) and strays == [] and table.get(1).state is RankState.RESUMED
    assert table.live() == {0, 1, 3} and not table.all_alive
    assert_in_sync(table)


def test_what_a_node_reaches_is_looked_up_again_once_a_record_is_replaced_or_rebound() -> None:
    table = relayed_table(3)
    node = (0, 1, 2)
    table.acknowledge(b"agent/0/1#", node, 1.0, RankState.PAUSED)
    old = table.get(1)
    table.add(RankRecord(rank=1, peer=b"agent/0/1#rank1.inc1", incarnation=1, pid=9, replica_endpoint="", held=(0,),
                         last_seen=1.5, state=RankState.PAUSED))
    table.acknowledge(b"agent/0/1#", node, 2.0, RankState.RESTORED)
    assert table.get(1).state is RankState.RESTORED and old.state is RankState.PAUSED and old.last_seen == 1.0
    table.rebind(table.get(2), b"agent/5/1#rank2.inc0")  # its node's agent came back on a new link
    heard, strays = table.acknowledge(b"agent/0/1#", node, 3.0, RankState.RESUMED)
    assert list(heard) == [0, 1] and strays == [2] and table.get(2).state is RankState.RESTORED
    assert_in_sync(table)
