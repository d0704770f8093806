"""Replication by the node agents: each rank's newest snapshot streams to the buddy node's agent.

Under ``mindft-launch`` a rank's two snapshot slots are files in its node agent's shared memory
(``state_dir/rank<R>/slot<i>.bin``, with ``slot<i>.json`` written once a capture is complete,
holding the checksums the capture computed). On several nodes each agent runs:

- a :class:`Sender` thread that notices a new manifest (two ``stat`` calls per rank per poll),
  reads that slot into a staging buffer, checks that the manifest did not change meanwhile (a
  capture that claims a slot unlinks its manifest first, so an unchanged manifest means the
  bytes are the ones it describes), and sends them with the recorded checksums (no second hash)
  over ONE long-lived CurveZMQ DEALER to the buddy node's keeper. Newest wins: per rank only the
  newest unsent snapshot is remembered, and one push is in flight per node, so memory is
  bounded by one staging buffer. The file is read, not mapped: a slot resized under the agent
  gives a short read (the push is skipped), never SIGBUS.
- a :class:`Keeper` (ROUTER) that writes the newest replica of each remote rank into its own
  shared memory, in the same slot format (``SnapshotStore(home=..., resume=True)`` reads it),
  and serves it back (:func:`mindft.snapshot.fetch_replica`, which verifies the checksums:
  they are checked on fetch and on restore, not on receipt).

Nothing here runs on a rank's step: the ranks neither push nor wait, and a dead keeper only
makes the sender's replicas fall behind. A replica that falls behind (its newest confirmed
step older than the newest local snapshot for more than :data:`LOST_AFTER` seconds, or more
than :data:`LOST_AFTER_CAPTURES` captures) is logged as lost protection, reported to the
controller (:class:`~mindft.protocol.ReplicaReport`, shown by ``mindft status``) and logged
again when it recovers.
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import zmq

from mindft.keys import CurveKeys, secure_client, secure_server, start_authenticator
from mindft.protocol import ReplicaReport
from mindft.snapshot import ReplicaHeader, SnapshotError, _check_frames, _Slot

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.05       # s between looks at the local ranks' manifests
LOST_AFTER = 5.0           # s a local snapshot may wait for its replica before protection counts as lost
LOST_AFTER_CAPTURES = 20   # or this many newer captures than the newest replica
ACK_TIMEOUT = 10.0         # s for the keeper to confirm a push, plus the bytes at ACK_MIN_RATE
ACK_MIN_RATE = 20e6        # bytes/s: slower than this the keeper counts as gone (reconnect, look it up again)
REPORT_INTERVAL = 1.0      # s between reports of the replicated steps to the controller (a change is sent)
FIND_INTERVAL = 1.0        # s between look-ups of the buddy node's keeper while it is unknown
KEEPER_POLL_MS = 100       # the keeper's thread wakes this often to notice close()
PIPE_HWM = 4               # messages (a push is one): one is in flight, a few leave room for a late ack


def node_ip(toward: str) -> str:
    """The local address this node uses to reach ``toward`` (no packet is sent)."""
    family = pysocket.AF_INET6 if ":" in toward else pysocket.AF_INET
    try:
        with pysocket.socket(family, pysocket.SOCK_DGRAM) as probe:
            probe.connect((toward, 9))
            return probe.getsockname()[0]
    except OSError:
        return toward


def _endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class Keeper:
    """Holds the newest replica of each remote rank in ``home`` (shared memory) and serves it back.

    One thread owns a ROUTER bound on ``ip``; with ``keys`` only job members get in (CurveZMQ +
    ZAP). Requests: ``push`` (header, array frames) → ``ok`` + ``{"owner_rank", "step"}``;
    ``fetch`` (``{"owner_rank"}``) → ``replica`` + header + frames, as :class:`~mindft.snapshot.ReplicaServer`.
    """

    def __init__(self, home: Path, ip: str, keys: Optional[CurveKeys], port: int = 0) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self._context = zmq.Context()
        self._authenticator = start_authenticator(self._context, keys)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.linger = 0
        # A replica is one message of many frames, as large as the state: count limits only.
        self._socket.sndhwm = self._socket.rcvhwm = PIPE_HWM
        secure_server(self._socket, keys)
        bind_ip = f"[{ip}]" if ":" in ip else ip
        if port:
            self._socket.bind(f"tcp://{bind_ip}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{bind_ip}")
        self.endpoint = _endpoint(ip, port)
        self._slots: Dict[int, _Slot] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mindft-keeper", daemon=True)
        self._thread.start()
        log.info("replica keeper listening on %s (%s), holding replicas in %s", self.endpoint,
                 "curve" if keys else "insecure", self.home)

    @property
    def held(self) -> Dict[int, int]:
        """{owner rank: step of the replica held}."""
        with self._lock:
            return {owner: slot.step for owner, slot in self._slots.items() if slot.complete}

    @property
    def nbytes(self) -> int:
        """Shared memory the replicas take."""
        with self._lock:
            return sum(b.nbytes for slot in self._slots.values() for b in slot.buffers.values())

    def close(self) -> None:
        """Stop serving (the files in ``home`` stay for whoever owns it)."""
        self._stop.set()
        self._thread.join()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._socket.poll(KEEPER_POLL_MS):
                    continue
                identity, *message = self._socket.recv_multipart(copy=False)
                try:
                    reply = self._handle(message)
                except Exception as error:  # one bad request must not stop the keeper
                    log.warning("replica keeper %s refused a request: %s", self.endpoint, error)
                    reply = [b"error", str(error).encode()]
                try:
                    self._socket.send_multipart([identity, *reply], flags=zmq.NOBLOCK)
                except zmq.Again:
                    log.debug("replica keeper: the requester's pipe is full; reply dropped")
        finally:
            self._socket.close(linger=0)

    def _handle(self, message: List[Any]) -> List[Any]:
        command = message[0].bytes if message else b""
        if command == b"push" and len(message) >= 2:
            header = ReplicaHeader.decode(message[1].bytes)
            _check_frames(header, message[2:])
            self._store(header, message[2:])
            return [b"ok", json.dumps({"owner_rank": header.owner_rank, "step": header.step}).encode()]
        if command == b"fetch" and len(message) == 2:
            try:
                owner = int(json.loads(message[1].bytes)["owner_rank"])
            except (ValueError, KeyError, TypeError) as error:
                raise SnapshotError(f"garbage fetch request ({error!r})") from None
            with self._lock:
                slot = self._slots.get(owner)
                if slot is None or not slot.complete:
                    held = sorted(o for o, s in self._slots.items() if s.complete)
                    raise SnapshotError(f"no replica of rank {owner} held here (holding {held})")
                header = ReplicaHeader(owner, slot.step, tuple(
                    (name, buffer.dtype.str, buffer.shape, int(slot.checksums[name]))
                    for name, buffer in slot.buffers.items()), dict(slot.meta), slot.algorithm)
                # Copies: a push of the same rank may overwrite the slot before ZeroMQ sends these.
                return [b"replica", header.encode(), *(buffer.tobytes() for buffer in slot.buffers.values())]
        raise SnapshotError(f"unknown request {command[:32]!r} with {len(message)} frames")

    def _store(self, header: ReplicaHeader, frames: List[Any]) -> None:
        """Write the replica into this owner's slot: no hash here (checked on fetch and restore)."""
        with self._lock:
            slot = self._slots.get(header.owner_rank)
            if slot is None:
                directory = self.home / f"rank{header.owner_rank}"
                directory.mkdir(parents=True, exist_ok=True)
                slot = self._slots[header.owner_rank] = _Slot(directory / "slot0.bin")
            slot.forget()
            slot._map([(name, dtype, tuple(shape)) for name, dtype, shape, _ in header.arrays])
            for (name, _, _, _), frame in zip(header.arrays, frames):
                target = slot.buffers[name].reshape(-1).view(np.uint8)
                if target.size:
                    target[:] = np.frombuffer(frame.buffer, dtype=np.uint8)
            slot.step, slot.meta, slot.algorithm = header.step, dict(header.meta), header.algorithm
            slot.checksums = {name: value for name, _, _, value in header.arrays}
            slot.record()
            slot.complete = True
        log.debug("holding the replica of rank %d, step %d", header.owner_rank, header.step)


@dataclass
class _Track:
    """What the sender knows of one local rank's snapshots and its replica."""

    rank: int
    home: Path
    seen: Dict[int, Tuple[int, int, int, bytes]] = field(default_factory=dict)  # slot → manifest identity
    captures: int = 0                       # snapshots noticed so far
    local_step: int = -1                    # the newest noticed
    pending: Optional[Tuple[int, int]] = None  # (slot, capture number) of the newest not yet sent
    noticed: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))  # (capture, at)
    replicated: int = -1                    # step the keeper confirmed last
    replicated_capture: int = 0
    behind_since: Optional[float] = None    # when the oldest snapshot newer than the replica was noticed
    lost: bool = False

    def behind(self, now: float) -> Tuple[int, float]:
        """(captures, seconds) the replica is behind the newest local snapshot."""
        if self.behind_since is None:
            return 0, 0.0
        return self.captures - self.replicated_capture, now - self.behind_since


def _identity(path: Path) -> Optional[Tuple[int, int, int, bytes]]:
    """What tells one manifest from the next: file timestamps are coarse (a clock tick) and tmpfs
    reuses inode numbers, so two fast captures can look alike; the head of the JSON holds the step."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        head = os.read(fd, 64)
    except OSError:
        return None
    finally:
        os.close(fd)
    return info.st_ino, info.st_mtime_ns, info.st_size, head


class Sender:
    """Streams the newest snapshot of each local rank to the buddy node's :class:`Keeper` (one thread).

    ``ranks`` maps each local rank to its snapshot directory. ``find_keeper()`` returns the
    keeper's endpoint or None while it is unknown (asked at most every :data:`FIND_INTERVAL`);
    ``report(ReplicaReport)`` is called from a thread of its own, newest report wins.
    """

    def __init__(self, ranks: Dict[int, Path], keys: Optional[CurveKeys],
                 find_keeper: Callable[[], Optional[str]], node: int = 0,
                 report: Optional[Callable[[ReplicaReport], None]] = None,
                 poll_interval: float = POLL_INTERVAL, lost_after: float = LOST_AFTER,
                 lost_after_captures: int = LOST_AFTER_CAPTURES, ack_timeout: float = ACK_TIMEOUT) -> None:
        self.node = node
        self._tracks = {rank: _Track(rank, Path(home)) for rank, home in sorted(ranks.items())}
        self._keys = keys
        self._find_keeper = find_keeper
        self._report = report
        self._poll = poll_interval
        self._lost_after = lost_after
        self._lost_after_captures = lost_after_captures
        self._ack_timeout = ack_timeout
        self._context = zmq.Context()
        self._socket: Optional[zmq.Socket] = None
        self.keeper: Optional[str] = None
        self._found_at = -float("inf")
        self._staging = np.empty(0, np.uint8)
        # (track, slot, step, capture number, sent at, deadline) of the one push in flight
        self._in_flight: Optional[Tuple[_Track, int, int, int, float, float]] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reported: Optional[Tuple] = None
        self._reported_at = -float("inf")
        self._mailbox: List[ReplicaReport] = []
        self._mail = threading.Condition()
        self.pushes = self.skipped = self.timeouts = 0
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

    def close(self) -> None:
        """Stop the thread and drop what is in flight."""
        self._stop.set()
        with self._mail:
            self._mail.notify_all()
        self._thread.join()
        if self._reporter.is_alive():
            self._reporter.join(1.0)  # a report waiting on a controller that is gone must not hold the agent
        self._context.term()

    # ---- the sender's thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._notice(now)
                if self._in_flight is None:
                    self._send_next(now)
                self._await_ack()
                self._judge(time.monotonic())
        except Exception:
            log.exception("the sender thread died; replicas are no longer sent")
            with self._lock:
                for track in self._tracks.values():
                    track.lost = True
            self._queue_report(force=True)
            raise
        finally:
            if self._socket is not None:
                self._socket.close(linger=0)

    def _notice(self, now: float) -> None:
        """Look for snapshots completed since the last look (a new manifest identity)."""
        for track in self._tracks.values():
            fresh = []
            for index in (0, 1):
                identity = _identity(track.home / f"slot{index}.json")
                if identity is None:
                    track.seen.pop(index, None)
                    continue
                if identity == track.seen.get(index):
                    continue
                track.seen[index] = identity
                step = _manifest_step(track.home / f"slot{index}.json")
                if step is not None:
                    fresh.append((step, index))
            # Both slots new since the last look: two captures, the newer one holds the higher step.
            for step, index in sorted(fresh):
                with self._lock:
                    track.captures += 1
                    track.local_step = step
                    track.pending = (index, track.captures)
                    track.noticed.append((track.captures, now))
                    if track.behind_since is None:
                        track.behind_since = now

    def _send_next(self, now: float) -> None:
        candidates = [t for t in self._tracks.values() if t.pending is not None]
        if not candidates:
            return
        if self.keeper is None:
            if now - self._found_at < FIND_INTERVAL:
                return
            self._found_at = now
            self.keeper = self._find_keeper()
            if self.keeper is None:
                return
            log.info("node %d streams its ranks' snapshots to the keeper at %s", self.node, self.keeper)
        # The rank whose replica is furthest behind goes first.
        track = min(candidates, key=lambda t: t.behind_since if t.behind_since is not None else now)
        index, capture = track.pending
        track.pending = None
        frames = self._read(track, index)
        if frames is None:
            self.skipped += 1
            return
        header, payload, nbytes = frames
        socket = self._connect()
        try:
            socket.send_multipart([b"push", header.encode(), *payload], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._reset("its pipe is full")
            track.pending = track.pending or (index, capture)
            return
        deadline = time.monotonic() + self._ack_timeout + nbytes / ACK_MIN_RATE
        self._in_flight = (track, index, header.step, capture, now, deadline)
        self.pushes += 1

    def _read(self, track: _Track, index: int) -> Optional[Tuple[ReplicaHeader, List[Any], int]]:
        """The slot's bytes and recorded checksums, or None if a capture claimed it meanwhile."""
        manifest = track.home / f"slot{index}.json"
        before = _identity(manifest)
        try:
            body = json.loads(manifest.read_text())
            layout = [(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in body["layout"]]
            checksums = {str(k): int(v) for k, v in body["checksums"].items()}
            step = int(body["step"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.debug("rank=%d slot %d: no readable manifest (%s)", track.rank, index, error)
            return None
        size = max((o + int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, d, s, o in layout), default=0)
        if self._staging.size < size:
            self._staging = np.empty(size, np.uint8)
        staging = self._staging
        try:
            with open(track.home / f"slot{index}.bin", "rb", buffering=0) as handle:
                got = handle.readinto(memoryview(staging)[:size]) if size else 0
        except OSError as error:
            log.debug("rank=%d slot %d: %s", track.rank, index, error)
            return None
        if got != size or _identity(manifest) != before or before is None:
            log.debug("rank=%d slot %d changed while it was read: skipped", track.rank, index)
            return None
        arrays, frames = [], []
        for name, dtype, shape, start in layout:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            arrays.append((name, np.dtype(dtype).str, shape, checksums[name]))
            frames.append(memoryview(staging)[start:start + nbytes])
        header = ReplicaHeader(track.rank, step, tuple(arrays), dict(body.get("meta", {})),
                               str(body.get("algorithm")))
        return header, frames, size

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.linger = 0
            socket.sndhwm = socket.rcvhwm = PIPE_HWM
            secure_client(socket, self._keys)
            socket.connect(self.keeper)
            self._socket = socket
        return self._socket

    def _reset(self, why: str) -> None:
        """Drop the connection and whatever it holds; look the keeper up again before the next push."""
        log.warning("no confirmation from the keeper at %s (%s); reconnecting", self.keeper, why)
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        # ZeroMQ may still read the staging buffer of the message it dropped: never reuse it.
        self._staging = np.empty(0, np.uint8)
        self._in_flight = None
        self.keeper = None
        self._found_at = -float("inf")

    def _await_ack(self) -> None:
        """Wait up to one poll interval for the keeper's answer to the push in flight."""
        if self._in_flight is None or self._socket is None:
            self._stop.wait(self._poll)
            return
        track, index, step, capture, sent, deadline = self._in_flight
        if not self._socket.poll(int(self._poll * 1000)):
            if time.monotonic() > deadline:
                self.timeouts += 1
                self._reset(f"rank {track.rank} step {step} unconfirmed after {time.monotonic() - sent:.1f} s")
                if track.pending is None:
                    track.pending = (index, capture)  # send it again, unless a newer one came meanwhile
            return
        reply = self._socket.recv_multipart()
        if reply[0] != b"ok" or len(reply) < 2:
            log.warning("the keeper at %s refused rank %d step %d: %s", self.keeper, track.rank,
                        step, b" ".join(reply[1:])[:200].decode(errors="replace"))
            self._in_flight = None
            return
        answer = json.loads(reply[1])
        if answer.get("owner_rank") != track.rank or answer.get("step") != step:
            return  # a late answer to an earlier push: keep waiting for ours
        self._in_flight = None
        now = time.monotonic()
        with self._lock:
            first = track.replicated < 0
            track.replicated, track.replicated_capture = step, capture
            newer = [at for number, at in track.noticed if number > capture]
            track.behind_since = newer[0] if newer else None
        if first:
            log.info("rank=%d step %d is held by the keeper at %s (%.3f s after it was noticed)",
                     track.rank, step, self.keeper, now - sent)

    def _judge(self, now: float) -> None:
        """Log and report lost protection (and its recovery)."""
        changed = False
        for track in self._tracks.values():
            with self._lock:
                captures, seconds = track.behind(now)
                lost = captures > self._lost_after_captures or seconds > self._lost_after
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

    # ---- reports to the controller ---------------------------------------------------------

    def _queue_report(self, force: bool = False) -> None:
        if self._report is None:
            return
        with self._lock:
            ranks = tuple(self._tracks)
            steps = tuple(t.replicated for t in self._tracks.values())
            lost = tuple(r for r, t in self._tracks.items() if t.lost)
        key = (steps, lost)
        now = time.monotonic()
        if key == self._reported or (not force and now - self._reported_at < REPORT_INTERVAL):
            return
        self._reported, self._reported_at = key, now
        with self._mail:
            self._mailbox[:] = [ReplicaReport(node=self.node, ranks=ranks, steps=steps, lost=lost)]
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


def _manifest_step(path: Path) -> Optional[int]:
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class NodeReplication:
    """The keeper and the sender of one node agent, wired to the job's controller."""

    def __init__(self, state_dir: Path, local_ranks: Sequence[int], nproc: int, nnodes: int, node_rank: int,
                 master_ip: str, controller_address: str, keys: Optional[CurveKeys]) -> None:
        from mindft.channel import request  # the control channel; imported here to keep this module light
        from mindft.protocol import StatusReply, StatusRequest

        self._request, self._status_request, self._status_type = request, StatusRequest, StatusReply
        self._address, self._keys = controller_address, keys
        buddy_node = (node_rank + 1) % nnodes
        self._buddy_ranks = set(range(buddy_node * nproc, (buddy_node + 1) * nproc))
        self.keeper = Keeper(Path(state_dir) / "replicas", node_ip(master_ip), keys)
        self.sender = Sender({rank: Path(state_dir) / f"rank{rank}" for rank in local_ranks}, keys,
                             self._find_keeper, node=node_rank, report=self._send_report)

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
                f"holding {len(held)} replica(s) of the previous node ({held}, {self.keeper.nbytes / 2**20:.1f} MiB)")

    def close(self) -> None:
        """Stop sending and serving."""
        self.sender.close()
        self.keeper.close()
