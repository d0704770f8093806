"""The keeper: holds the newest replica of each remote rank and serves it back.

A push is ``begin`` (the header, with the checksums the capture recorded: no second hash), the
keeper's ``have`` (the arrays it already holds), ``part`` messages for the others, and ``end``
(:mod:`mindft.replica.wire`); the keeper writes the parts into a second slot and, on ``end``
with every byte there, makes it the replica and frees the old one, so a push cut short (a dead
sender, a slot overwritten) never costs the replica held. With a spill directory the old one
moves to disk as the new one arrives (:mod:`mindft.replica.spill`). A keeper asks only for the
arrays that differ from its own ranks' snapshot of the same step and points into that snapshot
for the rest (:mod:`mindft.replica.sources`); a begin that comes before this node's ranks have
completed that step's capture waits for it, up to :data:`SHARE_WAIT`. Checksums are verified
when a replica is fetched (:func:`~mindft.replica.wire.fetch_replica`) or restored, not on receipt.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple

import numpy as np
import zmq

from mindft.net import sockets
from mindft.net.keys import CurveKeys, start_authenticator
from mindft.replica.sources import LocalSnapshot, own_copy, read_shared
from mindft.replica.spill import SPILL_DIRECTORY, Spill, in_memory_filesystem
from mindft.replica.wire import ReplicaHeader, check_frames, decode_json
from mindft.snapshot.slots import Slot, nbytes
from mindft.snapshot.store import SnapshotError
from mindft.observe.threadcpu import ThreadCpu

log = logging.getLogger(__name__)

KEEPER_POLL_MS = 100       # the keeper's thread wakes this often to notice close()
SHARE_WAIT = 2.0           # s a begin may wait for this node's own capture of its step (arrays to share)


def _own_layout(header: ReplicaHeader, shared: FrozenSet[str]) -> List[Tuple[str, str, Tuple[int, ...]]]:
    """(name, dtype, shape) of the arrays a replica holds itself, in header order."""
    return [(name, dtype, tuple(shape)) for name, dtype, shape, _ in header.arrays if name not in shared]


@dataclass
class _Incoming:
    """A replica arriving part by part until every byte is there: into a slot of its own, or
    into the held replica's behind its move to disk (``behind``)."""

    header: ReplicaHeader
    slot: Slot
    total: int
    shared: FrozenSet[str]  # arrays not sent: this node's snapshot of the same step holds them
    behind: Optional[Spill] = None  # the held replica moving to disk, which the parts must not overtake
    received: int = 0


@dataclass
class _Held:
    """A complete replica: the arrays in ``slot`` (or, while the next one arrives, moving to disk
    through ``spill``), the ``shared`` ones in a local snapshot."""

    index: int
    slot: Slot
    header: ReplicaHeader
    shared: FrozenSet[str]
    spill: Optional[Spill] = None

    def own(self) -> List[Tuple[str, str, Tuple[int, ...], int]]:
        """The arrays this replica holds itself (header order), not pointing into a local snapshot."""
        return [spec for spec in self.header.arrays if spec[0] not in self.shared]

    def own_bytes(self) -> Dict[str, bytes]:
        """Copies of the replica's own arrays (the next push may overwrite the memory)."""
        if self.spill is None or self.spill.synced == 0:
            return {name: self.slot.buffers[name].tobytes() for name, _, _, _ in self.own()}
        with open(self.spill.path, "rb") as handle:
            return {name: self.spill.read(name, self.slot.buffers.get(name), handle) for name, _, _, _ in self.own()}

    def forget_spill(self) -> None:
        """The replica is no longer held: stop moving it and remove its file."""
        if self.spill is not None:
            self.spill.cancel()
            try:
                self.spill.path.unlink(missing_ok=True)
            except OSError as error:
                log.warning("replica keeper: cannot remove %s: %s", self.spill.path, error.strerror or error)


@dataclass
class _Waiting:
    """A begin waiting for this node's capture of its step."""

    identity: Any
    header: ReplicaHeader
    until: float


class Keeper:
    """Holds the newest replica of each remote rank and serves it back.

    ``home`` (shared memory) keeps the replicas as files in a rank's slot format
    (``SnapshotStore(home=home / "rank<R>", resume=True)`` reads one that shares nothing); ``home=None``
    keeps them in this process's memory (a rank keeping its buddy's replica). ``local()`` lists the
    complete snapshots on this side a replica may point into (:func:`slot_files`,
    :func:`store_slots`; None: every array is sent). With a ``spill`` directory (on disk, not
    tmpfs) a held replica moves there while the next one of its rank arrives into its memory
    (:class:`~mindft.replica.spill.Spill`), so memory holds one replica per rank at any time and a sender lost
    mid-transfer is still restored (from disk and memory). ``cpu`` counts its threads' CPU
    (:attr:`~mindft.replica.sender.Sender.replica_cost`).
    One thread owns a ROUTER bound on ``ip``; with ``keys`` only job members get in (CurveZMQ +
    ZAP). Requests: ``begin`` → ``have`` + ``{"owner_rank", "step", "arrays"}`` (the indices not to
    send), ``part``, ``end`` (a streamed push, see :mod:`mindft.replica.wire`) → ``ok`` +
    ``{"owner_rank", "step"}``; ``push`` (header, array frames; one request) → the same; ``fetch``
    (``{"owner_rank"}``) → ``replica`` + header + frames: the replica held, or for one of this node's
    own ranks (``own``: rank → its slot directory) a copy of its newest snapshot, from which a node
    an elastic job grows by starts (data-parallel ranks hold the same state). Errors answer ``error``.
    """

    def __init__(self, home: Optional[Path], ip: str, keys: Optional[CurveKeys], port: int = 0,
                 local: Optional[Callable[[], List[LocalSnapshot]]] = None, spill: Optional[Path] = None,
                 cpu: Optional[ThreadCpu] = None, own: Optional[Callable[[int], Optional[Path]]] = None) -> None:
        self.home = None if home is None else Path(home)
        if self.home is not None:
            self.home.mkdir(parents=True, exist_ok=True)
        self._local = local
        self._own = own  # this node's own ranks' slot directories: a fetch of one serves a copy of its state
        self._spill = None if spill is None else Path(spill)
        if self._spill is not None and in_memory_filesystem(self._spill):
            log.warning("replica keeper: %s is in memory (tmpfs): a replica moved there while the next arrives "
                        "still takes memory; set MINDFT_DUMP_DIR to a directory on disk", self._spill)
        for stale in self._spill.glob("rank*.bin") if self._spill is not None else ():
            stale.unlink(missing_ok=True)  # left by a keeper of this node that was killed: nobody's now
        self._made: list[Path] = []  # the directories the spill needed, deepest first: removed at close if empty
        if self._spill is not None:
            self._made = [d for d in (self._spill, *self._spill.parents) if not d.exists()]
            try:
                self._spill.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                log.warning("replica keeper: cannot create %s (%s); a replica stays in memory while the next "
                            "arrives (two per rank)", self._spill, error.strerror or error)
                self._spill = None
        self._cpu = cpu
        self._context = zmq.Context() if cpu is None else cpu.name_context(zmq.Context())
        self._authenticator = start_authenticator(self._context, keys)
        self._socket, self.endpoint = sockets.keeper_router(self._context, keys, ip, port)
        self._held: Dict[int, _Held] = {}
        self._incoming: Dict[int, Tuple[int, _Incoming]] = {}
        self._waiting: Dict[int, _Waiting] = {}
        self.received_bytes = self.shared_bytes = 0  # of the replicas completed: sent, and pointed into
        self.spilled = 0  # replicas moved to disk while the next one arrived
        self._lock = threading.Lock()
        self._spilling = threading.Condition(self._lock)  # a spill moved on
        self._cannot_spill = False  # then a replica stays in memory while the next arrives
        self._spills: List[Spill] = []  # started, perhaps still writing (a cancelled one ends after its piece)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mindft-keeper", daemon=True)
        self._thread.start()
        log.info("replica keeper listening on %s (%s), holding replicas in %s", self.endpoint,
                 "curve" if keys else "insecure", self.home or "memory")

    @property
    def held(self) -> Dict[int, int]:
        """{owner rank: step of the replica held}."""
        with self._lock:
            return {owner: replica.header.step for owner, replica in self._held.items()}

    @property
    def nbytes(self) -> int:
        """Memory the replicas take (and the one arriving, while it does); shared arrays are not theirs."""
        with self._lock:
            slots = {id(r.slot): r.slot for r in self._held.values()}
            slots.update((id(i.slot), i.slot) for _, i in self._incoming.values())  # (the same slot, in place)
            return sum(b.nbytes for slot in slots.values() for b in slot.buffers.values())

    def close(self) -> None:
        """Stop serving (files in ``home`` stay for whoever owns it; memory is freed)."""
        self._stop.set()
        self._thread.join()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()
        with self._lock:
            for _, incoming in self._incoming.values():
                incoming.slot.forget()
            self._incoming.clear()
            spills = list(self._spills)
            for owner, replica in list(self._held.items()):
                if replica.spill is not None or self.home is None:  # nobody reads a spill file later
                    replica.forget_spill()
                    replica.slot.release()
                    del self._held[owner]
        for spill in spills:
            spill.thread.join()
        if self._spill is not None:
            # Its own directory, the spill directory other keepers of this dump directory may share,
            # and those it made for them: each left only if something else is in it.
            shared = [self._spill.parent] if self._spill.parent.name == SPILL_DIRECTORY else []
            for directory in dict.fromkeys([self._spill, *shared, *self._made]):
                try:
                    directory.rmdir()
                except OSError:
                    pass

    def _serve(self) -> None:
        if self._cpu is not None:
            self._cpu.count_this_thread()
        try:
            while not self._stop.is_set():
                if self._socket.poll(10 if self._waiting else KEEPER_POLL_MS):
                    identity, *message = self._socket.recv_multipart(copy=False)
                    try:
                        reply = self._handle(identity, message)
                    except Exception as error:  # one bad request must not stop the keeper
                        log.warning("replica keeper %s refused a request: %s", self.endpoint, error)
                        reply = [b"error", str(error).encode()]
                    if reply is not None:
                        self._send(identity, reply)
                for owner in list(self._waiting):
                    self._answer(owner, time.monotonic())
        finally:
            self._socket.close(linger=0)

    def _send(self, identity: Any, reply: List[Any]) -> None:
        try:
            self._socket.send_multipart([identity, *reply], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("replica keeper: the requester's pipe is full; reply dropped")

    def _handle(self, identity: Any, message: List[Any]) -> Optional[List[Any]]:
        command = message[0].bytes if message else b""
        if command == b"part" and len(message) == 3:
            self._part(decode_json(message[1]), message[2])
            return None
        if command == b"begin" and len(message) == 2:
            header = ReplicaHeader.decode(message[1].bytes)
            self._waiting[header.owner_rank] = _Waiting(identity, header, time.monotonic() + SHARE_WAIT)
            self._answer(header.owner_rank, time.monotonic())
            return None
        if command == b"end" and len(message) == 2:
            answer = decode_json(message[1])
            return self._end(int(answer["owner_rank"]), int(answer["step"]))
        if command == b"push" and len(message) >= 2:
            header = ReplicaHeader.decode(message[1].bytes)
            check_frames(header, message[2:])
            self._begin(header, frozenset())
            for index, frame in enumerate(message[2:]):
                self._part({"owner_rank": header.owner_rank, "step": header.step, "array": index, "offset": 0}, frame)
            return self._end(header.owner_rank, header.step)
        if command == b"fetch" and len(message) == 2:
            try:
                owner = int(decode_json(message[1])["owner_rank"])
            except (KeyError, TypeError, ValueError) as error:
                raise SnapshotError(f"garbage fetch request ({error!r})") from None
            return self._fetch(owner)
        raise SnapshotError(f"unknown request {command[:32]!r} with {len(message)} frames")

    def _answer(self, owner: int, now: float) -> None:
        """Answer a waiting begin with the arrays not to send, once this node's snapshot of its
        step is complete (or newer, or the wait is over)."""
        waiting = self._waiting[owner]
        header = waiting.header
        local = self._local() if self._local is not None else []
        if self._local is not None and now < waiting.until and not any(s.step >= header.step for s in local):
            return
        del self._waiting[owner]
        shared = frozenset(index for index, spec in enumerate(header.arrays)
                           if any(s.holds(header.step, header.algorithm, spec) for s in local))
        try:
            self._begin(header, frozenset(header.arrays[i][0] for i in shared))
        except Exception as error:
            log.warning("replica keeper %s refused a request: %s", self.endpoint, error)
            self._send(waiting.identity, [b"error", str(error).encode()])
            return
        self._send(waiting.identity, [b"have", json.dumps({"owner_rank": owner, "step": header.step,
                                                           "arrays": sorted(shared)}).encode()])

    def _begin(self, header: ReplicaHeader, shared: FrozenSet[str]) -> None:
        """A replica of ``header.owner_rank`` starts. With a spill directory the held one moves to
        disk meanwhile, and the new one takes its memory as it goes (same arrays) or its place
        once all of it is on disk (other arrays); without, it goes into the other slot."""
        owner = header.owner_rank
        sent = _own_layout(header, shared)
        with self._lock:
            held = self._held.get(owner)
            dropped = self._incoming.pop(owner, None)
            if dropped is not None and (held is None or dropped[1].slot is not held.slot):
                dropped[1].slot.release()  # a push cut short: what it wrote is garbage
            spill = None
            if self._spill is not None and not self._cannot_spill and held is not None and held.own():
                # (a data-parallel replica may hold nothing of its own)
                if held.spill is None:
                    held.slot.forget()  # its file is no longer a snapshot once the next one arrives into it
                    held.spill = Spill(self._spill / f"rank{owner}.bin",
                                        [(name, held.slot.buffers[name]) for name, _, _, _ in held.own()],
                                        self._spilling, self._spilled, self._cpu)
                    self._spills = [s for s in self._spills if s.thread.is_alive()] + [held.spill]
                spill = held.spill
            if spill is not None and held.slot.buffers and _own_layout(held.header, held.shared) == sent:
                index, slot = held.index, held.slot  # in place, behind the spill
            else:
                index = 1 - held.index if held is not None else 0
                slot = Slot(None if self.home is None else self._directory(owner) / f"slot{index}.bin")
                slot.forget()
            slot.prepare(sent)
            total = sum(nbytes(dtype, shape) for _, dtype, shape in sent)
            self._incoming[owner] = (index, _Incoming(header, slot, total, shared, spill))

    def _spilled(self) -> None:
        with self._lock:
            self.spilled += 1

    def _room(self, owner: int, incoming: _Incoming, name: str, end: int) -> None:
        """Wait (the lock held) until the part ending at byte ``end`` of array ``name`` may be written:
        the held replica's bytes it overwrites are on disk, or all of it when the part goes elsewhere."""
        spill, held = incoming.behind, self._held.get(owner)
        if spill is None or held is None or held.spill is not spill:
            return
        in_place = held.slot is incoming.slot
        need = spill.offsets[name] + end if in_place else spill.total
        while spill.synced < need and spill.failed is None and not self._stop.is_set():
            self._spilling.wait(KEEPER_POLL_MS / 1000)
        if spill.failed is not None:
            self._spill_failed(owner, held, in_place)
            raise SnapshotError(f"cannot move rank {owner}'s replica to disk: {spill.failed}")
        if spill.synced < need:
            raise SnapshotError("the keeper is closing")
        if not in_place and held.slot.buffers:
            held.slot.release()  # all on disk: its memory goes to the arriving replica

    def _spill_failed(self, owner: int, held: _Held, in_place: bool) -> None:
        """Spilling is over for this keeper: the held replica comes back to memory whole (the
        push writing into it is refused) and the next push goes into the other slot."""
        log.warning("replica keeper: cannot move rank %d's replica to disk (%s); from now on a replica stays in "
                    "memory while the next arrives (two per rank)", owner, held.spill.failed)
        self._cannot_spill = True
        spill = held.spill
        try:
            restored = held.own_bytes()
        except (OSError, SnapshotError) as error:
            log.error("rank=%d LOST its replica of step %d: it cannot be read back from %s (%s)", owner,
                      held.header.step, spill.path, error)
            del self._held[owner]
            restored = None
        if in_place:
            del self._incoming[owner]
        held.forget_spill()
        if restored is None:
            held.slot.release()
            return
        for name, data in restored.items():
            held.slot.buffers[name].reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        held.spill = None
        held.slot.complete = True
        if not held.shared:
            held.slot.record()

    def _part(self, where: Mapping[str, Any], frame: Any) -> None:
        """Copy one part into the arriving replica; parts of a push that was replaced are dropped."""
        try:
            owner, step, array, offset = (int(where[k]) for k in ("owner_rank", "step", "array", "offset"))
        except (KeyError, TypeError, ValueError) as error:
            raise SnapshotError(f"garbage part header ({error!r})") from None
        data = np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=np.uint8)
        with self._lock:
            entry = self._incoming.get(owner)
            if entry is None or entry[1].header.step != step:
                log.debug("dropped a part of rank %d step %d: no such push arriving", owner, step)
                return
            incoming = entry[1]
            if not 0 <= array < len(incoming.header.arrays):
                raise SnapshotError(f"part of rank {owner} step {step}: no array {array}")
            name = incoming.header.arrays[array][0]
            if name in incoming.shared:
                raise SnapshotError(f"part of rank {owner} step {step}: {name!r} was not asked for")
            target = incoming.slot.buffers[name].reshape(-1).view(np.uint8)
            if offset < 0 or offset + data.size > target.size:
                raise SnapshotError(f"part of rank {owner} step {step}: bytes {offset}..{offset + data.size} "
                                    f"outside {name!r} ({target.size} bytes)")
            self._room(owner, incoming, name, offset + data.size)
            if data.size:
                target[offset:offset + data.size] = data
            incoming.received += data.size

    def _end(self, owner: int, step: int) -> List[Any]:
        """The push is complete: the new replica replaces the one held (no hash here)."""
        with self._lock:
            entry = self._incoming.get(owner)
            if entry is None or entry[1].header.step != step:
                raise SnapshotError(f"end of rank {owner} step {step}: no such push arriving")
            index, incoming = entry
            old = self._held.get(owner)
            if incoming.received != incoming.total:
                del self._incoming[owner]
                if old is None or incoming.slot is not old.slot:
                    incoming.slot.release()
                raise SnapshotError(f"replica of rank {owner} step {step} is incomplete: "
                                    f"{incoming.received} of {incoming.total} bytes arrived")
            del self._incoming[owner]
            header, slot, shared = incoming.header, incoming.slot, incoming.shared
            slot.step, slot.meta, slot.algorithm = header.step, dict(header.meta), header.algorithm
            slot.checksums = {name: value for name, _, _, value in header.arrays if name not in shared}
            if not shared:  # a slot that points into another cannot be read back as a rank's own
                slot.record()
            slot.complete = True
            self._held[owner] = _Held(index, slot, header, shared)
            if old is not None:
                old.forget_spill()
                if old.slot is not slot:
                    old.slot.release()
            self.received_bytes += incoming.total
            self.shared_bytes += sum(nbytes(d, s) for name, d, s, _ in header.arrays if name in shared)
        log.debug("holding the replica of rank %d, step %d (%d of %d arrays shared with this node's snapshot)",
                  owner, step, len(shared), len(header.arrays))
        return [b"ok", json.dumps({"owner_rank": owner, "step": step}).encode()]

    def _fetch(self, owner: int) -> List[Any]:
        """The replica as a push would carry it; shared arrays are read from the local snapshot."""
        with self._lock:
            replica = self._held.get(owner)
        directory = self._own(owner) if replica is None and self._own is not None else None
        if directory is not None:  # read outside the lock: a push goes on meanwhile
            copy = own_copy(directory, owner)
            if copy is None:
                raise SnapshotError(f"rank {owner} of this node holds no complete snapshot")
            return [b"replica", copy[0].encode(), *copy[1]]
        with self._lock:
            replica = self._held.get(owner)
            if replica is None:
                raise SnapshotError(f"no replica of rank {owner} held here (holding {sorted(self._held)})")
            header = replica.header
            own = replica.own_bytes()
        local = self._local() if replica.shared and self._local is not None else []
        frames = []
        for spec in header.arrays:
            data = own.get(spec[0])
            if data is None:
                data = read_shared(local, header, spec)
            if data is None:
                raise SnapshotError(f"the replica of rank {owner}, step {header.step} shares {spec[0]!r} with "
                                    f"this node's snapshot of that step, which is no longer held")
            frames.append(data)
        return [b"replica", header.encode(), *frames]

    def _directory(self, owner: int) -> Path:
        directory = self.home / f"rank{owner}"
        directory.mkdir(parents=True, exist_ok=True)
        return directory
