"""The sender: streams the newest snapshot of each local rank to a keeper, off the step.

One thread and ONE long-lived CurveZMQ DEALER per process; one push in flight (the protocol is
in :mod:`mindft.replica.wire`). Newest wins: per rank only the newest unsent snapshot is
remembered; queues are bounded in messages (:data:`~mindft.net.sockets.REPLICA_HWM`), so a slow
or dead keeper costs a few chunks of memory and never blocks a step. Before a push is sealed
the sender checks that its source did not change meanwhile (an overwritten slot is not sent).
Whether a rank is still protected is the flow's rule (:class:`mindft.flow.replicas.Protection`):
the sender judges it after every wait, logs each change and reports it to the controller.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import zmq

from mindft.flow.cadence import WarmMean
from mindft.flow.replicas import ACK_MIN_RATE, LOST_AFTER, LOST_AFTER_CAPTURES, Protection, ProtectionChange
from mindft.net import sockets
from mindft.net.keys import CurveKeys
from mindft.protocol import ReplicaReport
from mindft.replica.sources import FileSource, Outgoing, Source, StoreSource
from mindft.observe.threadcpu import ThreadCpu

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.05       # s between looks at the local ranks' snapshots while idle
ACK_TIMEOUT = 10.0         # s for the keeper to confirm a push, plus the bytes at ACK_MIN_RATE
REPORT_INTERVAL = 1.0      # s between reports of the replicated steps to the controller (a change is sent)
FIND_INTERVAL = 1.0        # s between look-ups of the buddy node's keeper while it is unknown
PUSH_SMOOTHING = 0.5       # weight of the newest push's duration in a rank's smoothed figure


@dataclass
class _Track:
    """What the sender knows of one local rank's snapshots and its replica."""

    rank: int
    source: Source
    protection: Protection                  # how far its replica is behind, and the verdict on it
    local_step: int = -1                    # the newest snapshot noticed
    pending: Optional[Tuple[Any, int]] = None  # (token, capture number) of the newest not yet sent
    replicated: int = -1                    # step the keeper confirmed last
    confirmed: Any = None                   # the token of that push


@dataclass
class _Push:
    """The one push in flight."""

    track: _Track
    token: Any
    capture: int
    outgoing: Outgoing
    started: float
    deadline: float
    parts: Optional[Iterator[Tuple[int, int, Any]]] = None  # once the keeper said which arrays it has
    waiting: Optional[Tuple[int, int, Any]] = None  # a part the pipe had no room for
    trackers: List[Any] = field(default_factory=list)  # ZeroMQ's hold on zero-copy parts
    queued: bool = False                    # every part handed to ZeroMQ
    ended: bool = False                     # "end" sent: waiting for the keeper's answer

    @property
    def step(self) -> int:
        """The step of the snapshot being pushed."""
        return self.outgoing.header.step


class Sender:
    """Streams the newest snapshot of each local rank to a keeper (one thread, one connection).

    ``ranks`` maps each local rank to its snapshot directory (a node agent) or to a source
    (:class:`~mindft.replica.node.RankReplication` gives its store). ``find_keeper()`` returns the keeper's endpoint
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
        self._tracks = {rank: _Track(rank, source if isinstance(source, (FileSource, StoreSource))
                                     else FileSource(Path(source)), Protection(lost_after, lost_after_captures))
                        for rank, source in sorted(ranks.items())}
        self._keys = keys
        self._find_keeper = find_keeper
        self._report = report
        self._poll = poll_interval
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
        self.sent_bytes = 0  # of the parts handed to ZeroMQ (those of pushes that failed included)
        self.push_seconds: Optional[float] = None  # how long the newest confirmed push took
        self._replica_cost = WarmMean(PUSH_SMOOTHING)  # seconds of CPU per confirmed push (see _count_cost)
        self._thread = threading.Thread(target=self._run, name="mindft-replication", daemon=True)
        self._reporter = threading.Thread(target=self._report_loop, name="mindft-replica-report", daemon=True)
        self._thread.start()
        if report is not None:
            self._reporter.start()

    @property
    def replica_cost(self) -> Optional[float]:
        """Seconds of CPU a confirmed push takes, smoothed; None until a warm one (the first push,
        with its connection's set-up, is left out: :class:`~mindft.flow.cadence.WarmMean`)."""
        return self._replica_cost.value

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
            return tuple(rank for rank, track in self._tracks.items() if track.protection.lost)

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
                    track.protection.lost = True
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
                    track.local_step = step
                    track.pending = (token, track.protection.capture(now))

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
        track = min(candidates, key=lambda t: t.protection.behind_since
                    if t.protection.behind_since is not None else now)
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
        track.protection.nbytes = outgoing.nbytes
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
            self.sent_bytes += len(frame)
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
            self._socket = sockets.keeper_dealer(self._context, self._keys, self.keeper)
            self._replica_cost.cold_again()  # its first push pays the handshake (and any failed one's CPU)
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
        warmed = self.replica_cost is None
        self._count_cost(self.push_seconds)
        with self._lock:
            first = track.replicated < 0
            track.replicated, track.confirmed = push.step, push.token
            track.protection.confirmed(push.capture)
        if warmed and self.replica_cost is not None:
            self._queue_report(force=True)  # the first warm figure: the job's cadence waits for it
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
        self._replica_cost.add(push_seconds if used is None else used)

    def _judge(self, now: float) -> None:
        """Log and report each change of a rank's protection (the verdict is :meth:`Protection.judge`'s)."""
        changed = False
        for track in self._tracks.values():
            with self._lock:
                verdict = track.protection.judge(now)
                captures, seconds = track.protection.behind(now)
            if verdict is ProtectionChange.LOST:
                changed = True
                log.warning("rank=%d LOST PROTECTION: its newest replica (step %d) is %d capture(s), %.1f s behind "
                            "its newest snapshot (step %d); keeper %s", track.rank, track.replicated, captures,
                            seconds, track.local_step, self.keeper or "not found yet")
            elif verdict is ProtectionChange.RESTORED:
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
            lost = tuple(r for r, t in self._tracks.items() if t.protection.lost)
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
