"""Replication: each rank's newest snapshot streams to a keeper elsewhere, off the step.

Two users share one :class:`Sender` (a thread, ONE long-lived CurveZMQ DEALER) and one
:class:`Keeper` (a ROUTER thread):

- **node agents** (``mindft-launch`` on several nodes): a rank's two snapshot slots are files in
  its agent's shared memory (``state_dir/rank<R>/slot<i>.bin``, with ``slot<i>.json`` written once
  a capture is complete, holding the checksums the capture computed). The agent's sender notices
  a new manifest (two ``stat`` calls per rank per poll) and streams that slot file, read chunk by
  chunk, to the keeper of the next node's agent, which keeps the replicas in its own shared
  memory. The file is read, not mapped: a slot resized under the agent gives a short read (the
  push is dropped), never SIGBUS. Before the push is sealed the sender checks that the manifest
  did not change meanwhile (a capture that claims a slot unlinks its manifest first, so an
  unchanged manifest means the bytes sent are the ones it describes).
- **ranks with no agent replicating them** (started by hand or by msrun, or
  ``MINDFT_AGENT_REPLICATION=0``): :class:`RankReplication` streams the rank's
  :class:`~mindft.snapshot.SnapshotStore` slot itself, zero-copy (ZeroMQ reads the slot's
  memory), to the keeper in its buddy rank's process. The capture never waits for it: a capture
  that claims the slot while it is being sent makes the push fail its check before it is sealed
  (the slot's sequence number changed before ZeroMQ released every part), and the next one goes.

A push is ``begin`` (the header, with the checksums the capture recorded: no second hash), the
keeper's ``have`` (the arrays it already holds), ``part`` messages of at most :data:`CHUNK` bytes
for the others, and ``end``; the keeper writes the parts into a second slot and, on ``end`` with
every byte there, makes it the replica and frees the old one, so a push cut short (a dead sender,
a slot overwritten) never costs the replica held. With a spill directory
(:func:`replica_spill`) the old one moves to disk as the new one arrives, piece by piece, and the
new one takes its memory right behind the write (the same arrays; other arrays: once all of it
is on disk): memory holds one replica per rank, never two, the write overlaps the transfer, and
a push cut short leaves the old replica on disk up to where it got and in memory after.

Data-parallel ranks hold the same weights and optimizer state after every step (the all-reduce
gives each the same gradients), as MindIO TFT and torchft use when they recover a rank from a
live replica. A keeper therefore asks only for the arrays that differ from its own ranks'
snapshot of the same step (same name, dtype, shape and recorded checksum) and points into that
snapshot for the rest: a replica of a data-parallel rank costs its small differences, not a
state. The pointer is as good as the copy: a replica of step ``s`` restores a lost node only
together with the other ranks' snapshots of ``s``, the ones it points into. A begin that comes
before this node's ranks have completed that step's capture waits for it, up to
:data:`SHARE_WAIT`. Checksums
are verified when a replica is fetched (:func:`mindft.snapshot.fetch_replica`) or restored, not
on receipt. Newest wins: per rank only the newest unsent snapshot is remembered and one push is
in flight per sender; queues are bounded in messages (:data:`PIPE_HWM`), so a slow or dead keeper
costs a few chunks of memory and never blocks a step.

A replica that falls behind (its newest confirmed step older than the newest local snapshot for
more than ``lost_after`` seconds plus its bytes at :data:`ACK_MIN_RATE`, or more than
:data:`LOST_AFTER_CAPTURES` captures) is logged as
``LOST PROTECTION``, reported to the controller (:class:`~mindft.protocol.ReplicaReport`, shown by
``mindft status``) and logged again when it recovers.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import socket as pysocket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import zmq

from mindft.flow.cadence import smoothed
from mindft.keys import CurveKeys, secure_client, secure_server, start_authenticator
from mindft.protocol import ReplicaReport
from mindft.snapshot import (ReplicaHeader, SnapshotError, SnapshotStore, _check_frames, _Slot, manifest_identity,
                             read_manifest, size_text)
from mindft.threadcpu import ThreadCpu

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.05       # s between looks at the local ranks' snapshots while idle
LOST_AFTER = 5.0           # s a local snapshot may wait for its replica before protection counts as lost
LOST_AFTER_CAPTURES = 20   # or this many newer captures than the newest replica
ACK_TIMEOUT = 10.0         # s for the keeper to confirm a push, plus the bytes at ACK_MIN_RATE
ACK_MIN_RATE = 20e6        # bytes/s: slower than this the keeper counts as gone (reconnect, look it up again)
REPORT_INTERVAL = 1.0      # s between reports of the replicated steps to the controller (a change is sent)
FIND_INTERVAL = 1.0        # s between look-ups of the buddy node's keeper while it is unknown
KEEPER_POLL_MS = 100       # the keeper's thread wakes this often to notice close()
CHUNK = 1024 * 1024        # bytes per part message (4 MiB parts took ~35 MB more per sender and keeper, no faster)
PIPE_HWM = 4               # messages queued per direction: a few chunks, never a whole state
PUSH_SMOOTHING = 0.5       # weight of the newest push's duration in a rank's smoothed figure
SPILL_DIRECTORY = "replica-spill"  # in MINDFT_DUMP_DIR: one directory per keeper
SPILL_PIECE = 8 * 1024 * 1024  # bytes a keeper moving a replica to disk writes between syncs
SHARE_WAIT = 2.0           # s a begin may wait for this node's own capture of its step (arrays to share)


def node_ip(toward: str) -> str:
    """The local address this node uses to reach ``toward`` (no packet is sent)."""
    family = pysocket.AF_INET6 if ":" in toward else pysocket.AF_INET
    try:
        with pysocket.socket(family, pysocket.SOCK_DGRAM) as probe:
            probe.connect((toward, 9))
            return probe.getsockname()[0]
    except OSError:
        return toward


def replica_spill(dump_dir: Path, keeper: str) -> Path:
    """Where a keeper moves a replica while the next one arrives: beside the dying-gasp
    checkpoints (``MINDFT_DUMP_DIR``), on disk; one directory per keeper (``node<N>``, ``rank<R>``)."""
    return Path(dump_dir) / SPILL_DIRECTORY / keeper


def in_memory_filesystem(path: Path) -> bool:
    """True when ``path`` lies on tmpfs or ramfs (its mount in /proc/mounts): a file there is memory."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return False
    target = os.path.realpath(path)
    under = [(point, kind) for point, kind in mounts
             if target == point or target.startswith(point.rstrip("/") + "/")]
    return bool(under) and max(under, key=lambda mount: len(mount[0]))[1] in ("tmpfs", "ramfs")


def _endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def _own_layout(header: ReplicaHeader, shared: FrozenSet[str]) -> List[Tuple[str, str, Tuple[int, ...]]]:
    """(name, dtype, shape) of the arrays a replica holds itself, in header order."""
    return [(name, dtype, tuple(shape)) for name, dtype, shape, _ in header.arrays if name not in shared]


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class LocalSnapshot:
    """A complete snapshot of a rank on the keeper's side, which a replica may point into."""

    step: int
    algorithm: str
    arrays: Mapping[str, Tuple[str, Tuple[int, ...], int]]  # name → (dtype.str, shape, checksum)
    read: Callable[[str], Optional[bytes]]                  # an array's bytes now; None once overwritten

    def holds(self, step: int, algorithm: str, spec: Tuple[str, str, Tuple[int, ...], int]) -> bool:
        name, dtype, shape, value = spec
        return self.step == step and self.algorithm == algorithm and self.arrays.get(name) == (dtype, shape, value)


def slot_files(directories: Sequence[Path]) -> Callable[[], List[LocalSnapshot]]:
    """The complete snapshots in these ranks' slot files (a node agent's own ranks)."""

    def snapshots() -> List[LocalSnapshot]:
        found = []
        for directory in directories:
            for index in (0, 1):
                snapshot = _slot_file(Path(directory), index)
                if snapshot is not None:
                    found.append(snapshot)
        return found

    return snapshots


def _slot_file(directory: Path, index: int) -> Optional[LocalSnapshot]:
    manifest = read_manifest(directory / f"slot{index}.json")
    if manifest is None:
        return None
    where = {name: (_nbytes(dtype, shape), start) for name, dtype, shape, start in manifest.layout}

    def read(name: str) -> Optional[bytes]:
        size, start = where[name]
        try:
            with open(manifest.data, "rb") as handle:
                chunk = os.pread(handle.fileno(), size, start)
        except OSError:
            return None
        return chunk if len(chunk) == size and manifest.intact() else None

    return LocalSnapshot(manifest.step, manifest.algorithm, {
        name: (dtype, shape, manifest.checksums[name]) for name, dtype, shape, _ in manifest.layout}, read)


def store_slots(store: SnapshotStore) -> Callable[[], List[LocalSnapshot]]:
    """The complete snapshots of a rank's own store (a rank keeping its buddy's replica)."""

    def snapshots() -> List[LocalSnapshot]:
        found = []
        for view in store.views():
            def read(name: str, view: Any = view) -> Optional[bytes]:
                data = view.arrays[name].tobytes()
                return data if store.intact(view.seq) else None

            found.append(LocalSnapshot(view.step, view.algorithm, {
                name: (array.dtype.str, tuple(array.shape), int(view.checksums[name]))
                for name, array in view.arrays.items()}, read))
        return found

    return snapshots


def _read_shared(local: List[LocalSnapshot], header: ReplicaHeader,
                 spec: Tuple[str, str, Tuple[int, ...], int]) -> Optional[bytes]:
    """A shared array's bytes, from the first local snapshot of the replica's step that still holds them."""
    for snapshot in local:
        if snapshot.holds(header.step, header.algorithm, spec):
            data = snapshot.read(spec[0])
            if data is not None:
                return data
    return None


@dataclass
class _Incoming:
    """A replica arriving part by part until every byte is there: into a slot of its own, or
    into the held replica's behind its move to disk (``behind``)."""

    header: ReplicaHeader
    slot: _Slot
    total: int
    shared: FrozenSet[str]  # arrays not sent: this node's snapshot of the same step holds them
    behind: Optional["_Spill"] = None  # the held replica moving to disk, which the parts must not overtake
    received: int = 0


class _Spill:
    """A held replica moving to disk while the next one arrives, in a thread of its own: its own
    arrays, end to end in header order, written piece by piece; each piece synced and dropped
    from the page cache before ``synced`` (bytes) passes it. Below ``synced`` the arriving
    replica may take the memory (the keeper waits for it in :meth:`Keeper._part`), so the
    write and the transfer overlap and memory holds one replica throughout."""

    def __init__(self, path: Path, arrays: List[Tuple[str, np.ndarray]], changed: threading.Condition,
                 done: Callable[[], None], cpu: Optional[ThreadCpu]) -> None:
        self.path = path
        self.offsets: Dict[str, int] = {}
        self.sizes: Dict[str, int] = {}
        self.total = 0
        for name, array in arrays:
            self.offsets[name], self.sizes[name] = self.total, array.nbytes
            self.total += array.nbytes
        self.synced = 0
        self.failed: Optional[str] = None
        self._arrays = arrays
        self._changed = changed  # built on the keeper's lock
        self._done = done
        self._cpu = cpu
        self._cancelled = False
        self._started = time.perf_counter()
        self.thread = threading.Thread(target=self._counted_write, name="mindft-spill", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        """Stop writing (the replica is no longer held); the caller removes the file."""
        self._cancelled = True

    def read(self, name: str, memory: Optional[np.ndarray], handle: Any) -> bytes:
        """Array ``name`` of the replica being moved: what is synced from the file, the rest
        from ``memory`` (the keeper's lock held, so ``synced`` stands still)."""
        size, start = self.sizes[name], self.offsets[name]
        on_disk = min(max(self.synced - start, 0), size)
        data = os.pread(handle.fileno(), on_disk, start) if on_disk else b""
        if len(data) != on_disk:
            raise SnapshotError(f"spill file {self.path}: {len(data)} of {on_disk} bytes of {name!r} read back")
        if on_disk < size:
            data += memory.reshape(-1).view(np.uint8)[on_disk:].tobytes()
        return data

    def _counted_write(self) -> None:
        try:
            self._write()
        finally:
            if self._cpu is not None:
                self._cpu.add_this_thread()

    def _write(self) -> None:
        arrays, self._arrays = self._arrays, []  # the keeper frees the memory once it is on disk
        try:
            with open(self.path, "wb") as handle:
                descriptor, at = handle.fileno(), 0
                for _, array in arrays:
                    data = array.reshape(-1).view(np.uint8)
                    for start in range(0, data.size, SPILL_PIECE):
                        if self._cancelled:
                            return
                        piece = data[start:start + SPILL_PIECE]
                        handle.write(piece)
                        handle.flush()
                        os.fdatasync(descriptor)
                        # On disk: the page cache need not keep a copy in memory.
                        os.posix_fadvise(descriptor, at, piece.size, os.POSIX_FADV_DONTNEED)
                        at += piece.size
                        with self._changed:
                            self.synced = at
                            self._changed.notify_all()
        except OSError as error:
            with self._changed:
                self.failed = f"{error.strerror or error}: {self.path}"
                self._changed.notify_all()
            return
        log.debug("moved a replica to %s in %.3f s", self.path, time.perf_counter() - self._started)
        self._done()


@dataclass
class _Held:
    """A complete replica: the arrays in ``slot`` (or, while the next one arrives, moving to disk
    through ``spill``), the ``shared`` ones in a local snapshot."""

    index: int
    slot: _Slot
    header: ReplicaHeader
    shared: FrozenSet[str]
    spill: Optional[_Spill] = None

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
    (:class:`_Spill`), so memory holds one replica per rank at any time and a sender lost
    mid-transfer is still restored (from disk and memory). ``cpu`` counts its threads' CPU
    (:attr:`Sender.replica_cost`).
    One thread owns a ROUTER bound on ``ip``; with ``keys`` only job members get in (CurveZMQ +
    ZAP). Requests: ``begin`` → ``have`` + ``{"owner_rank", "step", "arrays"}`` (the indices not to
    send), ``part``, ``end`` (a streamed push, see the module docstring) → ``ok`` +
    ``{"owner_rank", "step"}``; ``push`` (header, array frames; one request) → the same; ``fetch``
    (``{"owner_rank"}``) → ``replica`` + header + frames. Errors answer ``error``.
    """

    def __init__(self, home: Optional[Path], ip: str, keys: Optional[CurveKeys], port: int = 0,
                 local: Optional[Callable[[], List[LocalSnapshot]]] = None, spill: Optional[Path] = None,
                 cpu: Optional[ThreadCpu] = None) -> None:
        self.home = None if home is None else Path(home)
        if self.home is not None:
            self.home.mkdir(parents=True, exist_ok=True)
        self._local = local
        self._spill = None if spill is None else Path(spill)
        if self._spill is not None and in_memory_filesystem(self._spill):
            log.warning("replica keeper: %s is in memory (tmpfs): a replica moved there while the next arrives "
                        "still takes memory; set MINDFT_DUMP_DIR to a directory on disk", self._spill)
        for stale in self._spill.glob("rank*.bin") if self._spill is not None else ():
            stale.unlink(missing_ok=True)  # left by a keeper of this node that was killed: nobody's now
        if self._spill is not None:
            try:
                self._spill.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                log.warning("replica keeper: cannot create %s (%s); a replica stays in memory while the next "
                            "arrives (two per rank)", self._spill, error.strerror or error)
                self._spill = None
        self._cpu = cpu
        self._context = zmq.Context() if cpu is None else cpu.name_context(zmq.Context())
        self._authenticator = start_authenticator(self._context, keys)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.linger = 0
        # Messages are at most a chunk (a one-request push is the state: counted as one).
        self._socket.sndhwm = self._socket.rcvhwm = PIPE_HWM
        secure_server(self._socket, keys)
        bind_ip = f"[{ip}]" if ":" in ip else ip
        if port:
            self._socket.bind(f"tcp://{bind_ip}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{bind_ip}")
        self.endpoint = _endpoint(ip, port)
        self._held: Dict[int, _Held] = {}
        self._incoming: Dict[int, Tuple[int, _Incoming]] = {}
        self._waiting: Dict[int, _Waiting] = {}
        self.received_bytes = self.shared_bytes = 0  # of the replicas completed: sent, and pointed into
        self.spilled = 0  # replicas moved to disk while the next one arrived
        self._lock = threading.Lock()
        self._spilling = threading.Condition(self._lock)  # a spill moved on
        self._cannot_spill = False  # then a replica stays in memory while the next arrives
        self._spills: List[_Spill] = []  # started, perhaps still writing (a cancelled one ends after its piece)
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
        if self._spill is not None:  # its directories, left only if something else is in them
            ours = [self._spill] + ([self._spill.parent] if self._spill.parent.name == SPILL_DIRECTORY else [])
            for directory in ours:
                try:
                    directory.rmdir()
                except OSError:
                    break

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
            self._part(_json(message[1]), message[2])
            return None
        if command == b"begin" and len(message) == 2:
            header = ReplicaHeader.decode(message[1].bytes)
            self._waiting[header.owner_rank] = _Waiting(identity, header, time.monotonic() + SHARE_WAIT)
            self._answer(header.owner_rank, time.monotonic())
            return None
        if command == b"end" and len(message) == 2:
            answer = _json(message[1])
            return self._end(int(answer["owner_rank"]), int(answer["step"]))
        if command == b"push" and len(message) >= 2:
            header = ReplicaHeader.decode(message[1].bytes)
            _check_frames(header, message[2:])
            self._begin(header, frozenset())
            for index, frame in enumerate(message[2:]):
                self._part({"owner_rank": header.owner_rank, "step": header.step, "array": index, "offset": 0}, frame)
            return self._end(header.owner_rank, header.step)
        if command == b"fetch" and len(message) == 2:
            try:
                owner = int(_json(message[1])["owner_rank"])
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
                    held.spill = _Spill(self._spill / f"rank{owner}.bin",
                                        [(name, held.slot.buffers[name]) for name, _, _, _ in held.own()],
                                        self._spilling, self._spilled, self._cpu)
                    self._spills = [s for s in self._spills if s.thread.is_alive()] + [held.spill]
                spill = held.spill
            if spill is not None and held.slot.buffers and _own_layout(held.header, held.shared) == sent:
                index, slot = held.index, held.slot  # in place, behind the spill
            else:
                index = 1 - held.index if held is not None else 0
                slot = _Slot(None if self.home is None else self._directory(owner) / f"slot{index}.bin")
                slot.forget()
            slot.prepare(sent)
            total = sum(_nbytes(dtype, shape) for _, dtype, shape in sent)
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
            self.shared_bytes += sum(_nbytes(d, s) for name, d, s, _ in header.arrays if name in shared)
        log.debug("holding the replica of rank %d, step %d (%d of %d arrays shared with this node's snapshot)",
                  owner, step, len(shared), len(header.arrays))
        return [b"ok", json.dumps({"owner_rank": owner, "step": step}).encode()]

    def _fetch(self, owner: int) -> List[Any]:
        """The replica as a push would carry it; shared arrays are read from the local snapshot."""
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
                data = _read_shared(local, header, spec)
            if data is None:
                raise SnapshotError(f"the replica of rank {owner}, step {header.step} shares {spec[0]!r} with "
                                    f"this node's snapshot of that step, which is no longer held")
            frames.append(data)
        return [b"replica", header.encode(), *frames]

    def _directory(self, owner: int) -> Path:
        directory = self.home / f"rank{owner}"
        directory.mkdir(parents=True, exist_ok=True)
        return directory


def _json(frame: Any) -> Any:
    try:
        return json.loads(frame.bytes if hasattr(frame, "bytes") else frame)
    except ValueError as error:
        raise SnapshotError(f"garbage request ({error})") from None


class _Outgoing:
    """One snapshot on its way out: its header, its bytes part by part (``parts(skip)``: all but the
    arrays the keeper has), and whether they still hold."""

    def __init__(self, header: ReplicaHeader, nbytes: int, parts: Callable[[FrozenSet[int]], Iterator[Tuple[int, int, Any]]],
                 intact: Callable[[], bool], zero_copy: bool, close: Callable[[], None] = lambda: None) -> None:
        self.header, self.nbytes, self.parts = header, nbytes, parts
        self.intact, self.zero_copy, self.close = intact, zero_copy, close


class _FileSource:
    """A rank's slot files in a node agent's shared memory (the agent's sender)."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.seen: Dict[int, Tuple[int, int, int, bytes]] = {}  # slot → manifest identity

    def notice(self) -> List[Tuple[int, Any]]:
        """(step, slot index) of snapshots completed since the last look, oldest first."""
        fresh = []
        for index in (0, 1):
            identity = manifest_identity(self.home / f"slot{index}.json")
            if identity is None:
                self.seen.pop(index, None)
                continue
            if identity == self.seen.get(index):
                continue
            self.seen[index] = identity
            manifest = read_manifest(self.home / f"slot{index}.json")
            if manifest is not None:
                fresh.append((manifest.step, index))
        # Both slots new since the last look: two captures, the newer one holds the higher step.
        return sorted(fresh)

    def open(self, rank: int, index: Any) -> Optional[_Outgoing]:
        """The slot's bytes (read as they are sent) and recorded checksums; None if it is gone."""
        manifest = read_manifest(self.home / f"slot{index}.json")
        if manifest is None:
            return None
        try:
            fd = os.open(manifest.data, os.O_RDONLY)
        except OSError as error:
            log.debug("rank=%d slot %d: no readable snapshot (%s)", rank, index, error)
            return None
        layout = manifest.layout
        header = ReplicaHeader(rank, manifest.step, tuple((name, dtype, shape, manifest.checksums[name])
                                                          for name, dtype, shape, _ in layout),
                               manifest.meta, manifest.algorithm)
        short = []

        def parts(skip: FrozenSet[int]) -> Iterator[Tuple[int, int, Any]]:
            for array, (_, dtype, shape, start) in enumerate(layout):
                if array in skip:
                    continue
                size = _nbytes(dtype, shape)
                for offset in range(0, size, CHUNK):
                    wanted = min(CHUNK, size - offset)
                    data = os.pread(fd, wanted, start + offset)
                    if len(data) != wanted:
                        short.append(offset)  # the file shrank: a capture claimed the slot
                        return
                    yield array, offset, data

        def intact() -> bool:
            return not short and manifest.intact()

        descriptor = [fd]

        def close() -> None:
            if descriptor:
                os.close(descriptor.pop())

        return _Outgoing(header, sum(_nbytes(d, s) for _, d, s, _ in layout), parts, intact, False, close)


class _StoreSource:
    """A rank's own :class:`SnapshotStore`: its slot is sent as it is, zero-copy."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.epoch = 0  # a restore starts a new one: a push of the timeline before it proves nothing
        self._seen: Optional[Tuple[int, int]] = None

    def notice(self) -> List[Tuple[int, Any]]:
        view = self.store.view()
        if view is None:
            return []
        token = (view.seq, self.epoch)
        if token == self._seen:
            return []
        self._seen = token
        return [(view.step, token)]

    def open(self, rank: int, token: Any) -> Optional[_Outgoing]:
        seq = token[0]
        view = self.store.view()
        if view is None or view.seq != seq:
            return None  # a newer one is in the slot to keep: it is noticed next
        header = ReplicaHeader(rank, view.step, tuple(
            (name, array.dtype.str, array.shape, int(view.checksums[name])) for name, array in view.arrays.items()),
            dict(view.meta), view.algorithm)
        flats = [array.reshape(-1).view(np.uint8) for array in view.arrays.values()]

        def parts(skip: FrozenSet[int]) -> Iterator[Tuple[int, int, Any]]:
            for array, flat in enumerate(flats):
                if array not in skip:
                    for offset in range(0, flat.size, CHUNK):
                        yield array, offset, memoryview(flat[offset:offset + CHUNK])

        return _Outgoing(header, sum(f.size for f in flats), parts, lambda: self.store.intact(seq), True)


Source = Union[_FileSource, _StoreSource]


@dataclass
class _Track:
    """What the sender knows of one local rank's snapshots and its replica."""

    rank: int
    source: Source
    captures: int = 0                       # snapshots noticed so far
    local_step: int = -1                    # the newest noticed
    pending: Optional[Tuple[Any, int]] = None  # (token, capture number) of the newest not yet sent
    noticed: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))  # (capture, at)
    replicated: int = -1                    # step the keeper confirmed last
    replicated_capture: int = 0
    confirmed: Any = None                   # the token of that push
    behind_since: Optional[float] = None    # when the oldest snapshot newer than the replica was noticed
    lost: bool = False
    nbytes: int = 0                         # the size of the newest push: a large one may take longer

    def behind(self, now: float) -> Tuple[int, float]:
        """(captures, seconds) the replica is behind the newest local snapshot."""
        if self.behind_since is None:
            return 0, 0.0
        return self.captures - self.replicated_capture, now - self.behind_since


@dataclass
class _Push:
    """The one push in flight."""

    track: _Track
    token: Any
    capture: int
    outgoing: _Outgoing
    started: float
    deadline: float
    parts: Optional[Iterator[Tuple[int, int, Any]]] = None  # once the keeper said which arrays it has
    waiting: Optional[Tuple[int, int, Any]] = None  # a part the pipe had no room for
    trackers: List[Any] = field(default_factory=list)  # ZeroMQ's hold on zero-copy parts
    queued: bool = False                    # every part handed to ZeroMQ
    ended: bool = False                     # "end" sent: waiting for the keeper's answer

    @property
    def step(self) -> int:
        return self.outgoing.header.step


class Sender:
    """Streams the newest snapshot of each local rank to a :class:`Keeper` (one thread, one connection).

    ``ranks`` maps each local rank to its snapshot directory (a node agent) or to a source
    (:class:`RankReplication` gives its store). ``find_keeper()`` returns the keeper's endpoint
    or None while it is unknown: asked at most every :data:`FIND_INTERVAL` and after a failed
    push, or, with ``cheap_lookup``, before every push and while one is in flight (a restarted
    buddy serves elsewhere). ``report(ReplicaReport)`` is called from a thread of its own, newest
    report wins; ``on_change()`` from the sender's thread when a push is confirmed or a rank's
    protection is lost or restored. ``cpu`` counts the CPU of this process's replication threads
    (the sender's, and the keeper's it is given to): :attr:`replica_cost` is what one push costs.
    """

    def __init__(self, ranks: Mapping[int, Union[Path, str, Source]], keys: Optional[CurveKeys],
                 find_keeper: Callable[[], Optional[str]], node: int = 0,
                 report: Optional[Callable[[ReplicaReport], None]] = None,
                 poll_interval: float = POLL_INTERVAL, lost_after: float = LOST_AFTER,
                 lost_after_captures: int = LOST_AFTER_CAPTURES, ack_timeout: float = ACK_TIMEOUT,
                 cheap_lookup: bool = False, on_change: Optional[Callable[[], None]] = None,
                 cpu: Optional[ThreadCpu] = None) -> None:
        self.node = node
        self._who = f"node {node}" if node >= 0 else f"rank={next(iter(ranks), -1)}"
        self._tracks = {rank: _Track(rank, source if isinstance(source, (_FileSource, _StoreSource))
                                     else _FileSource(Path(source))) for rank, source in sorted(ranks.items())}
        self._keys = keys
        self._find_keeper = find_keeper
        self._report = report
        self._poll = poll_interval
        self._lost_after = lost_after
        self._lost_after_captures = lost_after_captures
        self._ack_timeout = ack_timeout
        self._cheap_lookup = cheap_lookup
        self._on_change = on_change
        self._cpu = cpu
        self._cpu_mark = None if cpu is None else cpu.seconds()
        self._context = zmq.Context() if cpu is None else cpu.name_context(zmq.Context())
        self._socket: Optional[zmq.Socket] = None
        self.keeper: Optional[str] = None
        self._found_at = -float("inf")
        self._push: Optional[_Push] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._reported: Optional[Tuple] = None
        self._reported_at = -float("inf")
        self._mailbox: List[ReplicaReport] = []
        self._mail = threading.Condition()
        self.pushes = self.skipped = self.timeouts = 0
        self.shared_arrays = 0  # arrays a keeper already had (data-parallel weights): not sent
        self.push_seconds: Optional[float] = None  # how long the newest confirmed push took
        self.replica_cost: Optional[float] = None  # seconds of CPU per confirmed push, smoothed (see _count_cost)
        self._thread = threading.Thread(target=self._run, name="mindft-replication", daemon=True)
        self._reporter = threading.Thread(target=self._report_loop, name="mindft-replica-report", daemon=True)
        self._thread.start()
        if report is not None:
            self._reporter.start()

    @property
    def replicated(self) -> Dict[int, int]:
        """{local rank: newest step the keeper confirmed holding (-1: none)}."""
        with self._lock:
            return {rank: track.replicated for rank, track in self._tracks.items()}

    @property
    def local(self) -> Dict[int, int]:
        """{local rank: newest snapshot step noticed (-1: none)}."""
        with self._lock:
            return {rank: track.local_step for rank, track in self._tracks.items()}

    @property
    def lost(self) -> Tuple[int, ...]:
        """Local ranks whose replica fell behind (lost protection)."""
        with self._lock:
            return tuple(rank for rank, track in self._tracks.items() if track.lost)

    @property
    def in_flight(self) -> Optional[Tuple[int, int]]:
        """(rank, step) of the push not yet confirmed, if any."""
        push = self._push
        return None if push is None else (push.track.rank, push.step)

    def confirmed(self, rank: int) -> Any:
        """The source's token of ``rank``'s newest confirmed push (None: none yet)."""
        with self._lock:
            return self._tracks[rank].confirmed

    def wake(self) -> None:
        """Look at the sources now rather than at the next poll (a capture completed)."""
        self._wake.set()

    def close(self) -> None:
        """Stop the thread and drop what is in flight."""
        self._stop.set()
        self._wake.set()
        with self._mail:
            self._mail.notify_all()
        self._thread.join()
        if self._reporter.is_alive():
            self._reporter.join(1.0)  # a report waiting on a controller that is gone must not hold the agent
        self._context.term()

    # ---- the sender's thread ---------------------------------------------------------------

    def _run(self) -> None:
        if self._cpu is not None:
            self._cpu.count_this_thread()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._notice(now)
                if self._push is None:
                    self._start(now)
                if self._push is not None:
                    self._pump(self._push)
                self._wait()
                self._judge(time.monotonic())
        except Exception:
            log.exception("the sender thread died; replicas are no longer sent")
            with self._lock:
                for track in self._tracks.values():
                    track.lost = True
            self._queue_report(force=True)
            self._changed()
            raise
        finally:
            self._drop_push()
            if self._socket is not None:
                self._socket.close(linger=0)

    def _notice(self, now: float) -> None:
        """Look for snapshots completed since the last look."""
        for track in self._tracks.values():
            for step, token in track.source.notice():
                with self._lock:
                    track.captures += 1
                    track.local_step = step
                    track.pending = (token, track.captures)
                    track.noticed.append((track.captures, now))
                    if track.behind_since is None:
                        track.behind_since = now

    def _lookup(self, now: float) -> Optional[str]:
        """The keeper to push to now (reconnecting when it moved), or None while it is unknown."""
        if self._cheap_lookup:
            found = self._find_keeper()
            if found != self.keeper:
                if self.keeper is not None:
                    self._reset(f"the keeper moved to {found}", warn=False)
                self.keeper = found
                if found is not None:
                    log.info("%s streams its snapshots to the keeper at %s", self._who, found)
            return self.keeper
        if self.keeper is None:
            if now - self._found_at < FIND_INTERVAL:
                return None
            self._found_at = now
            self.keeper = self._find_keeper()
            if self.keeper is not None:
                log.info("%s streams its ranks' snapshots to the keeper at %s", self._who, self.keeper)
        return self.keeper

    def _start(self, now: float) -> None:
        candidates = [t for t in self._tracks.values() if t.pending is not None]
        if not candidates or self._lookup(now) is None:
            return
        # The rank whose replica is furthest behind goes first.
        track = min(candidates, key=lambda t: t.behind_since if t.behind_since is not None else now)
        token, capture = track.pending
        track.pending = None
        outgoing = track.source.open(track.rank, token)
        if outgoing is None:
            self.skipped += 1
            return
        socket = self._connect()
        try:
            socket.send_multipart([b"begin", outgoing.header.encode()], flags=zmq.NOBLOCK)
        except zmq.Again:
            outgoing.close()
            self._reset("its pipe is full")
            track.pending = track.pending or (token, capture)
            return
        deadline = now + self._ack_timeout + outgoing.nbytes / ACK_MIN_RATE
        track.nbytes = outgoing.nbytes
        self._push = _Push(track, token, capture, outgoing, now, deadline)
        self.pushes += 1

    def _pump(self, push: _Push) -> None:
        """Hand ZeroMQ the next parts while the pipe has room; seal the push once they are all out."""
        if push.ended or push.parts is None:
            return
        socket = self._socket
        while not push.queued:
            part = push.waiting or next(push.parts, None)
            push.waiting = None
            if part is None:
                push.queued = True
                break
            if not push.outgoing.intact():
                self._abort(push, "overwritten while it was sent")
                return
            array, offset, data = part
            where = json.dumps({"owner_rank": push.track.rank, "step": push.step, "array": array,
                                "offset": offset}).encode()
            frame = zmq.Frame(data, track=push.outgoing.zero_copy)
            try:
                socket.send_multipart([b"part", where, frame], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                push.waiting = part
                return
            if push.outgoing.zero_copy:
                push.trackers = [t for t in push.trackers if not t.done]
                push.trackers.append(frame.tracker)
        # The parts read the source's memory until ZeroMQ lets go of them: only then does an
        # unchanged source prove that what went out is the snapshot the header describes.
        # Wait here (up to a poll interval): nothing else is due before this push's end.
        waited_until = time.monotonic() + self._poll
        for tracker in push.trackers:
            try:
                tracker.wait(max(0.0, waited_until - time.monotonic()))
            except zmq.NotDone:
                return
        push.trackers = []
        if not push.outgoing.intact():
            self._abort(push, "overwritten while it was sent")
            return
        try:
            socket.send_multipart([b"end", json.dumps({"owner_rank": push.track.rank, "step": push.step}).encode()],
                                  flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        push.ended = True
        push.outgoing.close()

    def _abort(self, push: _Push, why: str) -> None:
        """Give up this push (the keeper drops what arrived at the next begin); the next snapshot goes."""
        log.debug("rank=%d step %d not replicated: %s", push.track.rank, push.step, why)
        self.skipped += 1
        push.outgoing.close()
        self._push = None

    def _drop_push(self) -> None:
        if self._push is not None:
            self._push.outgoing.close()
            self._push = None

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.linger = 0
            socket.sndhwm = socket.rcvhwm = PIPE_HWM
            secure_client(socket, self._keys)
            socket.connect(self.keeper)
            self._socket = socket
        return self._socket

    def _reset(self, why: str, warn: bool = True) -> None:
        """Drop the connection and whatever it holds; look the keeper up again before the next push."""
        log.log(logging.WARNING if warn else logging.INFO, "%s: dropping the connection to the keeper at %s (%s)",
                self._who, self.keeper, why)
        push = self._push
        self._drop_push()
        if push is not None and push.track.pending is None:
            push.track.pending = (push.token, push.capture)  # send it again, unless a newer one came meanwhile
        if self._socket is not None:
            self._socket.close(linger=0)  # ZeroMQ drops the queued parts (and lets go of their memory)
            self._socket = None
        self.keeper = None
        self._found_at = -float("inf")

    def _wait(self) -> None:
        """Wait up to one poll interval for the keeper, room in the pipe, or a new snapshot."""
        push, socket = self._push, self._socket
        if push is None or socket is None:
            self._wake.wait(self._poll)
            self._wake.clear()
            return
        if push.parts is None:
            events, timeout = zmq.POLLIN, self._poll  # the keeper's answer to begin
        elif not push.queued:
            events, timeout = zmq.POLLIN | zmq.POLLOUT, self._poll
        elif not push.ended:
            events, timeout = zmq.POLLIN, 0.0  # ZeroMQ still holds parts: _pump waits for them
        else:
            events, timeout = zmq.POLLIN, self._poll
        if socket.poll(int(timeout * 1000), events) & zmq.POLLIN:
            self._receive(socket)
        if self._push is push and time.monotonic() > push.deadline:
            self.timeouts += 1
            self._reset(f"rank {push.track.rank} step {push.step} unconfirmed after "
                        f"{time.monotonic() - push.started:.1f} s")
        elif self._cheap_lookup and self._push is not None:
            self._lookup(time.monotonic())

    def _receive(self, socket: zmq.Socket) -> None:
        reply = socket.recv_multipart()
        push = self._push
        if reply[0] == b"error":
            detail = b" ".join(reply[1:])[:200].decode(errors="replace")
            if push is not None:
                log.warning("the keeper at %s refused rank %d step %d: %s", self.keeper, push.track.rank,
                            push.step, detail)
                self._abort(push, "refused")
            return
        if len(reply) < 2 or push is None:
            return
        answer = json.loads(reply[1])
        track = push.track
        if answer.get("owner_rank") != track.rank or answer.get("step") != push.step:
            return  # a late answer to an earlier push: keep waiting for ours
        if reply[0] == b"have" and push.parts is None:
            have = frozenset(int(i) for i in answer.get("arrays", ()))
            push.parts = push.outgoing.parts(have)
            self.shared_arrays += len(have)
            return
        if reply[0] != b"ok" or not push.ended:
            return
        self._push = None
        now = time.monotonic()
        self.push_seconds = now - push.started
        self._count_cost(self.push_seconds)
        with self._lock:
            first = track.replicated < 0
            track.replicated, track.replicated_capture, track.confirmed = push.step, push.capture, push.token
            newer = [at for number, at in track.noticed if number > push.capture]
            track.behind_since = newer[0] if newer else None
        if first:
            log.info("rank=%d step %d is held by the keeper at %s (%.3f s after it was sent)",
                     track.rank, push.step, self.keeper, now - push.started)
        self._changed()

    def _count_cost(self, push_seconds: float) -> None:
        """What a replica costs: the CPU this process's replication threads used since the previous
        push was confirmed (the sender's, its ZeroMQ threads' where CurveZMQ encrypts, and the
        keeper's, which takes the buddy's pushes at the same cadence, if it shares ``cpu``), or
        without ``cpu``, or where the CPU cannot be read, the push's duration. Both ends work at
        once on the cores training uses, so the CPU is what training loses, not the duration."""
        reading = None if self._cpu is None else self._cpu.seconds()
        used = None if reading is None or self._cpu_mark is None else reading - self._cpu_mark
        self._cpu_mark = reading
        self.replica_cost = smoothed(self.replica_cost, push_seconds if used is None else used, PUSH_SMOOTHING)

    def _judge(self, now: float) -> None:
        """Log and report lost protection (and its recovery)."""
        changed = False
        for track in self._tracks.values():
            with self._lock:
                captures, seconds = track.behind(now)
                lost = (captures > self._lost_after_captures
                        or seconds > self._lost_after + track.nbytes / ACK_MIN_RATE)
                was, track.lost = track.lost, lost
            if lost and not was:
                changed = True
                log.warning("rank=%d LOST PROTECTION: its newest replica (step %d) is %d capture(s), %.1f s behind "
                            "its newest snapshot (step %d); keeper %s", track.rank, track.replicated, captures,
                            seconds, track.local_step, self.keeper or "not found yet")
            elif was and not lost:
                changed = True
                log.warning("rank=%d protection restored: replica of step %d held by %s", track.rank,
                            track.replicated, self.keeper)
        self._queue_report(force=changed)
        if changed:
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:  # the owner's business: replication goes on
                log.exception("%s: replication change handler failed", self._who)

    # ---- reports to the controller ---------------------------------------------------------

    def _queue_report(self, force: bool = False) -> None:
        if self._report is None:
            return
        with self._lock:
            ranks = tuple(self._tracks)
            steps = tuple(t.replicated for t in self._tracks.values())
            lost = tuple(r for r, t in self._tracks.items() if t.lost)
            cost = self.replica_cost if self.node >= 0 else None
            cpu = 0.0 if cost is None else round(cost * len(self._tracks), 4)
        key = (steps, lost)
        now = time.monotonic()
        if key == self._reported or (not force and now - self._reported_at < REPORT_INTERVAL):
            return
        self._reported, self._reported_at = key, now
        with self._mail:
            self._mailbox[:] = [ReplicaReport(node=self.node, ranks=ranks, steps=steps, lost=lost,
                                              cpu_seconds=cpu)]
            self._mail.notify()

    def _report_loop(self) -> None:
        while True:
            with self._mail:
                while not self._mailbox and not self._stop.is_set():
                    self._mail.wait()
                if self._stop.is_set():
                    return
                report = self._mailbox.pop()
            try:
                self._report(report)
            except Exception as error:  # the controller may be busy or gone: the next report says it again
                log.debug("report to the controller failed: %s", error)
                self._reported = None


class RankReplication:
    """A rank's own replication when no node agent replicates it (see the module docstring).

    The session tells it of each capture (:meth:`captured`) and restore (:meth:`restored`);
    a :class:`Sender` streams the store's newest snapshot to the keeper at ``find_keeper()``
    (the buddy rank's). :meth:`reportable` is the newest step this rank may report finished:
    a step report tells the other ranks they may overwrite older snapshots, so it must not
    pass a capture whose replica has not arrived, or a kill of this rank would leave no step
    that every rank, this one through its replica, still holds. Training never waits for it;
    only the report does, and ``release()`` is called (from the sender's thread) when it may
    go. A replica later than ``lost_after`` seconds is lost protection: logged, reported, and
    the reports go on without it until it is back.
    """

    def __init__(self, rank: int, store: SnapshotStore, keys: Optional[CurveKeys],
                 find_keeper: Callable[[], Optional[str]], report: Optional[Callable[[ReplicaReport], None]],
                 release: Callable[[], None], lost_after: float, ack_timeout: float = ACK_TIMEOUT,
                 cpu: Optional[ThreadCpu] = None) -> None:
        self.rank = rank
        self._source = _StoreSource(store)
        self._release = release
        self._lock = threading.Lock()
        # (capture seq, step) of the snapshots taken whose replica is not confirmed, oldest first
        self._unconfirmed: collections.deque = collections.deque(maxlen=64)
        self.sender = Sender({rank: self._source}, keys, find_keeper, node=-1, report=report,
                             lost_after=lost_after, ack_timeout=ack_timeout, cheap_lookup=True,
                             on_change=self._changed, cpu=cpu)
        store.on_complete = self.sender.wake

    @classmethod
    def attach(cls, processor: Any, store: SnapshotStore, buddy: int, lost_after: float,
               keys: Optional[CurveKeys], cpu: Optional[ThreadCpu] = None) -> RankReplication:
        """Replicate ``processor``'s rank to ``buddy``'s keeper (from the processor's endpoint map),
        with reports to the controller and the step reports held back as :meth:`reportable` says."""
        replication = cls(processor.rank, store, keys, lambda: processor.endpoint_of(buddy),
                          processor.report_replica, processor.release_reports, lost_after, cpu=cpu)
        processor.report_limit = replication.reportable
        return replication

    def captured(self, seq: int, step: int) -> None:
        """The store started capturing ``step`` as capture ``seq`` (training thread)."""
        with self._lock:
            self._unconfirmed.append((seq, step))
        self.sender.wake()

    def restored(self, step: int) -> None:
        """Training was rolled back to ``step``: the replica must hold it again before reports go on."""
        with self._lock:
            self._source.epoch += 1
            self._unconfirmed.clear()
            self._unconfirmed.append((-1, step))  # cleared by the first push of the new epoch: that snapshot
        self.sender.wake()

    def reportable(self, position: int) -> int:
        """The newest step, at most ``position``, this rank may report finished now."""
        with self._lock:
            if not self._unconfirmed or self.rank in self.sender.lost:
                return position
            return min(position, self._unconfirmed[0][1] - 1)

    @property
    def unconfirmed(self) -> Tuple[int, ...]:
        """Steps captured (or restored) whose replica has not been confirmed yet."""
        with self._lock:
            return tuple(step for _, step in self._unconfirmed)

    def close(self) -> None:
        """Stop sending (what is in flight is dropped)."""
        self._source.store.on_complete = None
        self.sender.close()

    def _changed(self) -> None:
        token = self.sender.confirmed(self.rank)
        with self._lock:
            if token is not None and token[1] == self._source.epoch:
                while self._unconfirmed and self._unconfirmed[0][0] <= token[0]:
                    self._unconfirmed.popleft()
        self._release()


class NodeReplication:
    """The keeper and the sender of one node agent, wired to the job's controller."""

    def __init__(self, state_dir: Path, local_ranks: Sequence[int], nproc: int, nnodes: int, node_rank: int,
                 master_ip: str, controller_address: str, keys: Optional[CurveKeys],
                 spill: Optional[Path] = None) -> None:
        from mindft.channel import request  # the control channel; imported here to keep this module light
        from mindft.protocol import StatusReply, StatusRequest

        self._request, self._status_request, self._status_type = request, StatusRequest, StatusReply
        self._address, self._keys = controller_address, keys
        buddy_node = (node_rank + 1) % nnodes
        self._buddy_ranks = set(range(buddy_node * nproc, (buddy_node + 1) * nproc))
        cpu = ThreadCpu()  # the node's replication, both ends: what the overhead budget counts
        self.keeper = Keeper(Path(state_dir) / "replicas", node_ip(master_ip), keys,
                             local=slot_files([Path(state_dir) / f"rank{rank}" for rank in local_ranks]), spill=spill,
                             cpu=cpu)
        self.sender = Sender({rank: Path(state_dir) / f"rank{rank}" for rank in local_ranks}, keys,
                             self._find_keeper, node=node_rank, report=self._send_report, cpu=cpu)

    @property
    def endpoint(self) -> str:
        """This node's keeper: the ranks announce it when they register."""
        return self.keeper.endpoint

    def _find_keeper(self) -> Optional[str]:
        try:
            status = self._request(self._address, self._keys, self._status_request(), FIND_INTERVAL * 2)
        except Exception as error:
            log.debug("cannot ask the controller for the buddy node's keeper: %s", error)
            return None
        for row in getattr(status, "ranks", ()):
            if row.rank in self._buddy_ranks and row.replica_endpoint.startswith("tcp://"):
                return row.replica_endpoint
        return None

    def _send_report(self, report: ReplicaReport) -> None:
        self._request(self._address, self._keys, report, REPORT_INTERVAL * 5)

    def summary(self) -> str:
        """One line for the end of the job: what was sent and what is held."""
        sent, held = self.sender.replicated, self.keeper.held
        return (f"replication: sent {self.sender.pushes} replica(s) (newest confirmed per rank: {sent}; "
                f"{self.sender.skipped} skipped as overwritten while read, {self.sender.timeouts} unconfirmed); "
                f"holding {len(held)} replica(s) of the previous node ({held}, {size_text(self.keeper.nbytes)}; "
                f"received {size_text(self.keeper.received_bytes)}, shared {size_text(self.keeper.shared_bytes)} "
                f"with this node's snapshots; {self.keeper.spilled} moved to disk while the next arrived)")

    def close(self) -> None:
        """Stop sending and serving."""
        self.sender.close()
        self.keeper.close()
