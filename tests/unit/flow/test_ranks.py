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
