"""The rank table: who registered with which incarnation, who is alive, how far each got.

Liveness is judged from the ``now`` the caller passes; nothing here reads a clock.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Iterator, Mapping, Optional

from mindft.flow.effects import Peer, broadcast_target
from mindft.protocol import RankState


@dataclass
class RankRecord:
    """One rank's current incarnation.

    ``alive`` follows ``state`` (none of DEAD, OFF_DEVICE, LOST); while the record is in a
    :class:`RankTable`, every assignment to ``state`` also moves it between the table's
    per-state counts (:meth:`RankTable.count`) and, when ``alive`` flips, in or out of the
    table's ranks that are down (:meth:`RankTable.live`).
    """

    rank: int
    peer: Peer
    incarnation: int
    pid: int
    replica_endpoint: str
    held: tuple[int, ...]
    last_seen: float
    state: RankState = RankState.REGISTERED
    progress: int = 0   # the last step it reported finished
    restarts: int = 0
    held_round: int = -1  # the recovery round in which ``held`` was reported
    alive = True  # not a field: set with every assignment to ``state`` (below)
    target = b""  # not a field: where a broadcast reaches it (set by the table from ``peer``)


class _CountedState:
    """``RankRecord.state`` as a setter only: reads are plain attribute reads (a record's
    state and ``alive`` are read for every message the controller receives), and every
    assignment updates ``alive`` and the bookkeeping of the table holding the record, so that
    "has every rank finished" costs O(1), not a scan of the table per ``Done``, and a broadcast
    to the live ranks is not a scan of the table per phase."""

    def __set__(self, record: RankRecord, state: RankState) -> None:
        values = record.__dict__
        old = values.get("state")
        was = values.get("alive", True)
        values["state"] = state
        values["alive"] = alive = state is not _DEAD and state is not _OFF_DEVICE and state is not _LOST
        table = values.get("_table")
        if table is not None and old is not state:
            counts = table._in_state
            counts[old] -= 1
            counts[state] += 1
            if alive is not was:
                table._flipped(record.rank, alive)


_DEAD, _OFF_DEVICE, _LOST = RankState.DEAD, RankState.OFF_DEVICE, RankState.LOST
# (an Enum's class attribute costs 3 times a global)


# After @dataclass, which made the field's default an __init__ default: __init__ assigns
# ``self.state = state`` through the descriptor, and reads find the instance's own value.
RankRecord.state = _CountedState()  # type: ignore[assignment]


class RankTable:
    """Every rank's record, plus the slowest rank's progress kept in O(1) per report."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._records: dict[int, RankRecord] = {}
        self._by_peer: dict[Peer, int] = {}
        self._at: Counter[int] = Counter()  # progress -> number of ranks there
        self._in_state = dict.fromkeys(RankState, 0)  # state -> number of records in it (kept by the records)
        self._down: set[int] = set()  # the ranks whose record is not alive (kept by the records)
        self._peers: Optional[tuple[Peer, ...]] = None  # peers(), until a record is added or rebound, or flips alive
        self.added = 0  # records added so far: what was derived from the records' fixed fields is stale when it grows
        self._known: dict[Peer, tuple[Iterable[int], list[RankRecord]]] = {}  # see reached
        self.slowest = 0
        # rank → its record, or None: the dictionary's own lookup (read for every message the job gets).
        self.get: Callable[[int], Optional[RankRecord]] = self._records.get

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RankRecord]:
        return iter(self._records.values())


    def by_peer(self, peer: Peer) -> Optional[RankRecord]:
        rank = self._by_peer.get(peer)
        return None if rank is None else self._records[rank]

    @property
    def complete(self) -> bool:
        return len(self._records) == self.world_size

    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self._records]

    def count(self, state: RankState) -> int:
        """How many records are in ``state``, in O(1)."""
        return self._in_state[state]

    @property
    def state_counts(self) -> Mapping[RankState, int]:
        """Records per state, every state listed (a read-only live view)."""
        return MappingProxyType(self._in_state)

    def peers(self) -> tuple[Peer, ...]:
        """Where a broadcast to the live ranks goes: each one's peer, a relay's once for all its ranks.
        Kept until the live records or their peers change (each phase of a round broadcasts to the same)."""
        if self._peers is None:
            self._peers = tuple(dict.fromkeys(r.target for r in self._records.values() if r.alive))
        return self._peers

    def numbers(self) -> set[int]:
        """Every rank with a record."""
        return set(self._records)

    def live(self) -> set[int]:
        """The ranks whose record is alive, in O(down ranks) Python work."""
        return set(self._records).difference(self._down)

    @property
    def all_alive(self) -> bool:
        """No record is DEAD, OFF_DEVICE or LOST, in O(1)."""
        return not self._down

    def _flipped(self, rank: int, alive: bool) -> None:
        """``rank``'s record, in this table, became alive (``alive``) or not."""
        if alive:
            self._down.discard(rank)
        else:
            self._down.add(rank)
        self._peers = None

    def add(self, record: RankRecord) -> Optional[RankRecord]:
        """Insert or replace ``record.rank``'s record; returns the one it replaced."""
        old = self._records.get(record.rank)
        if old is not None:
            self._by_peer.pop(old.peer, None)
            self._count(old.progress, -1)
            if old.__dict__.pop("_table", None) is not None:
                self._in_state[old.state] -= 1
            self._down.discard(old.rank)
        if record.__dict__.get("_table") is not None and old is not record:
            raise ValueError(f"rank {record.rank}'s record is already in a table")
        self._records[record.rank] = record
        self._by_peer[record.peer] = record.rank
        record.target = broadcast_target(record.peer)
        self._count(record.progress, +1)
        record.__dict__["_table"] = self
        self._in_state[record.state] += 1
        if not record.alive:
            self._down.add(record.rank)
        self._peers = None
        self.added += 1
        self._known.clear()
        return old

    def set_states(self, records: Iterable[RankRecord], state: RankState, keep: Optional[RankState] = None,
                   seen: Optional[float] = None) -> None:
        """Every one of ``records`` (of this table) in ``state``, but those in ``keep``, and each heard at
        ``seen`` (None: as it was): what assigning each one's ``state`` does, with the counts moved once."""
        alive = state is not _DEAD and state is not _OFF_DEVICE and state is not _LOST
        counts, moved = self._in_state, 0
        for record in records:
            values = record.__dict__
            if seen is not None:
                values["last_seen"] = seen
            old = values["state"]
            if old is state or old is keep:
                continue
            if values["alive"] is not alive:
                self._flipped(values["rank"], alive)
            values["state"], values["alive"] = state, alive
            counts[old] -= 1
            moved += 1
        counts[state] += moved

    def acknowledge(self, target: Peer, ranks: Iterable[int], now: float, state: RankState,
                    keep: Optional[RankState] = None, held: Optional[tuple[int, ...]] = None,
                    held_round: Optional[int] = None) -> tuple[Iterable[int], list[int]]:
        """Of ``ranks``, those whose record is reached through ``target`` and alive were heard at ``now``
        and are in ``state`` (but those in ``keep``), holding ``held`` (None: as they were) reported in
        ``held_round`` (None: as it was). One pass, each record touched once: a node's acknowledgement
        of a phase moves all its ranks, and a phase brings one per node. Returns the ranks heard (``ranks``
        itself when every one was live and ``target``'s) and those not ``target``'s."""
        alive = state is not _DEAD and state is not _OFF_DEVICE and state is not _LOST
        counts, moved = self._in_state, 0
        records, strays = self.reached(target, ranks)
        skipped = strays.copy()
        for record in records:
            values = record.__dict__
            if not values["alive"]:
                skipped.append(values["rank"])
                continue
            values["last_seen"] = now
            if held is not None:
                values["held"] = held
            if held_round is not None:
                values["held_round"] = held_round
            old = values["state"]
            if old is state or old is keep:
                continue
            if not alive:
                self._flipped(values["rank"], alive)
            values["state"], values["alive"] = state, alive
            counts[old] -= 1
            moved += 1
        counts[state] += moved
        if skipped:
            ranks = [rank for rank in ranks if rank not in skipped]
        return ranks, strays

    def reached(self, target: Peer, ranks: Iterable[int]) -> tuple[list[RankRecord], list[int]]:
        """The records of ``ranks`` reached through ``target``, and the ranks that are not. A node names
        the same ranks phase after phase: what was found for it is kept until a record is added or
        rebound (a rank's batch of one is not kept: a rank's own peer names only itself)."""
        known = self._known.get(target)
        if known is not None and known[0] == ranks:
            return known[1], []
        get, records, strays = self._records.get, [], []
        for rank in ranks:
            record = get(rank)
            if record is None or record.target != target:
                strays.append(rank)
            else:
                records.append(record)
        if not strays and len(records) > 1:
            self._known[target] = (tuple(ranks), records)
        return records, strays

    def rebind(self, record: RankRecord, peer: Peer) -> None:
        """The same incarnation reconnected under a new peer address."""
        self._by_peer.pop(record.peer, None)
        record.peer, record.target = peer, broadcast_target(peer)
        self._by_peer[peer] = record.rank
        self._peers = None
        self._known.clear()

    @property
    def fastest(self) -> int:
        """The progress of the rank furthest ahead (0: none registered), in O(distinct steps)."""
        return max(self._at, default=0)

    def advance(self, record: RankRecord, step: int) -> bool:
        """Record that ``record`` finished ``step``; True when the slowest rank's progress rose."""
        if step <= record.progress:
            return False
        self._count(record.progress, -1)
        record.progress = step
        self._count(step, +1)
        return self._settle_slowest()

    def reset_progress(self, step: int) -> None:
        """After a rollback every rank is at ``step``."""
        self._at = Counter({step: len(self._records)})
        for record in self._records.values():
            record.progress = step
        self.slowest = step

    def silent(self, now: float, dead_after: float) -> list[RankRecord]:
        """Live ranks not heard from for longer than ``dead_after``."""
        return [r for r in self._records.values() if r.alive and now - r.last_seen > dead_after]

    def _count(self, step: int, delta: int) -> None:
        self._at[step] += delta
        if self._at[step] <= 0:
            del self._at[step]
        if delta > 0 and (step < self.slowest or len(self._records) == 0):
            self.slowest = step

    def _settle_slowest(self) -> bool:
        if not self.complete or self.slowest in self._at:
            return False
        before, self.slowest = self.slowest, min(self._at)
        return self.slowest > before
