"""The job's event log: what the controller and the node agents did, as JSON lines in the run directory.

Node 0's controller appends to ``RUN_DIR/events.jsonl`` (the job's view: every transition, the
faults, the ladder's decisions, the orders to the nodes, the end); each node agent appends to
``RUN_DIR/events-node<N>.jsonl`` (its processes' starts and exits, the scheduler's, when
MindSpore's cluster formed).
Ranks never write: logging costs nothing per step.

Each line is one :class:`Event`: the time (``time``, ISO-8601 UTC, and ``at``, epoch seconds),
who wrote it (``source``), the record's ``kind`` and ``v`` (its version) and the record's own
fields. The records are versioned dataclasses, like the wire messages of :mod:`mindft.protocol`;
:func:`decode` rejects a version it does not know. A file is bounded: past :data:`MAX_BYTES` it is
renamed ``<name>.1`` (replacing an older one) and a new file starts, so a job keeps at most twice
that per file. :mod:`mindft.observe.timeline` turns the events into a timeline per recovery.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Optional, Union

log = logging.getLogger(__name__)

VERSION = 1
CONTROLLER_FILE = "events.jsonl"
MAX_BYTES = 8 * 1024 * 1024  # per file; one older generation (<name>.1) is kept, so ≤ 16 MiB per writer


def node_file(node: int) -> str:
    """The name of node ``node``'s agent's event file in the run directory (-1: a spare's)."""
    return f"events-node{node}.jsonl" if node >= 0 else "events-spare.jsonl"


class EventError(ValueError):
    """A line that is not an event of a known kind and version."""


@dataclass(frozen=True)
class JobMoved:
    """The job moved from ``from_state`` to ``to_state`` (:class:`~mindft.flow.Transition`);
    ``round``: the recovery's round, ``step``: the step every rank finished; ``detect``: on the move
    that starts a recovery, the seconds from its first fault to that move, as the controller measured
    them (the figure it logs; -1 on other moves)."""

    KIND = "transition"
    from_state: str
    to_state: str
    reason: str
    round: int = 0
    step: int = -1
    detect: float = -1.0


@dataclass(frozen=True)
class FaultSeen:
    """A fault the current recovery is for (``rank`` -1: MindSpore's scheduler); ``node`` ≥ 0: its
    node was lost; ``collateral``: no fault of its own, it restarts with every worker."""

    KIND = "fault"
    rank: int
    fault: str
    step: int
    reason: str
    node: int = -1
    collateral: bool = False


@dataclass(frozen=True)
class LadderDecision:
    """The rung of the recovery ladder the job took: ``in_place``, ``restart_all`` or ``dying_gasp``."""

    KIND = "ladder"
    rung: str
    reason: str


@dataclass(frozen=True)
class OrderSent:
    """An order to the node agent that runs ``rank``: ``kill`` (its process ``pid``; ``restart``:
    start it again at once) or ``start``."""

    KIND = "order"
    rank: int
    order: str
    reason: str
    pid: int = 0
    restart: bool = False


@dataclass(frozen=True)
class NodeGiven:
    """Lost node ``node`` given to a warm spare (the job's ``adoption``-th), and why."""

    KIND = "node_given"
    node: int
    adoption: int
    reason: str


@dataclass(frozen=True)
class WorldResized:
    """The job went on with ``members`` (the nodes' numbers before, in their new order), ``world_size``
    ranks, in ``term``, leaving the ``lost`` nodes behind (:mod:`mindft.flow.elastic`); at ``step``, the
    slowest rank's progress when it was decided (the rollback follows)."""

    KIND = "world_resized"
    members: tuple
    lost: tuple
    world_size: int
    term: int
    step: int
    reason: str


@dataclass(frozen=True)
class TookCommand:
    """The standby controller on ``node`` took command of the job: ``term`` after ``old_term``, and why."""

    KIND = "took_command"
    node: int
    old_term: int
    term: int
    reason: str


@dataclass(frozen=True)
class ControllerFollowed:
    """A node agent's controller at ``old`` said nothing for ``silent`` seconds: it follows the standby
    at ``new`` (term ``term``); ``here``: that standby is this node's own, started now."""

    KIND = "controller_followed"
    old: str
    new: str
    term: int
    silent: float
    here: bool = False


@dataclass(frozen=True)
class RankSlow:
    """Rank ``rank`` (node ``node``, -1: unknown) flagged slow (``slow``) or cleared; ``ratio``: its own work
    per step over its peers' median in the deciding window (:mod:`mindft.flow.slow`)."""

    KIND = "rank_slow"
    rank: int
    node: int
    slow: bool
    ratio: float
    reason: str


@dataclass(frozen=True)
class ProcessStartRecord:
    """A node agent started a process: ``role`` ``worker`` (``rank``, incarnation ``restarts``) or
    ``scheduler``; ``warm``: forked from the warm process (False: cold, also when the warm path
    fell back, ``detail`` says why)."""

    KIND = "process_start"
    role: str
    pid: int
    rank: int = -1
    restarts: int = 0
    warm: bool = False
    detail: str = ""


@dataclass(frozen=True)
class ProcessExitRecord:
    """A process of a node agent's exited with ``code`` (negative: killed by that signal)."""

    KIND = "process_exit"
    role: str
    pid: int
    code: int
    rank: int = -1


@dataclass(frozen=True)
class ClusterFormed:
    """MindSpore's scheduler ``pid`` says every worker joined its cluster (``init()`` returns on the ranks)."""

    KIND = "cluster_formed"
    pid: int


@dataclass(frozen=True)
class JobFinished:
    """The controller's verdict: the job is over with ``exit_code``; ``seconds``: its wall time by
    bucket, productive training and badput (:mod:`mindft.flow.goodput`)."""

    KIND = "finish"
    exit_code: int
    reason: str
    seconds: dict = dataclasses.field(default_factory=dict)


Record = Union[JobMoved, FaultSeen, LadderDecision, OrderSent, NodeGiven, WorldResized, TookCommand, ControllerFollowed, RankSlow,
               ProcessStartRecord, ProcessExitRecord, ClusterFormed, JobFinished]
RECORDS: dict[str, type] = {cls.KIND: cls for cls in
                            (JobMoved, FaultSeen, LadderDecision, OrderSent, NodeGiven, WorldResized, TookCommand,
                             ControllerFollowed,
                             RankSlow, ProcessStartRecord, ProcessExitRecord, ClusterFormed, JobFinished)}


@dataclass(frozen=True)
class Event:
    """One line of an event log: ``record``, written by ``source`` at ``at`` (epoch seconds)."""

    at: float
    source: str
    record: Record

    @property
    def kind(self) -> str:
        return self.record.KIND


def iso_time(at: float) -> str:
    """``at`` (epoch seconds) as ISO-8601 UTC with milliseconds."""
    return datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def encode(event: Event) -> str:
    """One JSON line (without the newline)."""
    fields = {"time": iso_time(event.at), "at": round(event.at, 6), "source": event.source,
              "kind": event.record.KIND, "v": VERSION}
    fields.update(dataclasses.asdict(event.record))
    return json.dumps(fields, ensure_ascii=False)


def decode(line: str) -> Event:
    """The event on ``line``; :class:`EventError` for anything else."""
    try:
        fields = json.loads(line)
    except ValueError as error:
        raise EventError(f"not JSON: {error}") from None
    if not isinstance(fields, dict):
        raise EventError("not a JSON object")
    version, kind = fields.get("v"), fields.get("kind")
    if version != VERSION:
        raise EventError(f"event version {version!r} is not supported (this mindft reads version {VERSION})")
    cls = RECORDS.get(kind)
    if cls is None:
        raise EventError(f"unknown event kind {kind!r}; known kinds: {', '.join(sorted(RECORDS))}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return Event(float(fields["at"]), str(fields.get("source", "")),
                     cls(**{k: v for k, v in fields.items() if k in names}))
    except (KeyError, TypeError, ValueError) as error:
        raise EventError(f"bad {kind} event: {error}") from None


class EventLog:
    """Appends events to ``path`` for ``source``, from any thread, bounded as the module says; the
    file stays open until :meth:`close`.

    Writing never fails its caller: an unwritable file is logged once and the events are dropped
    (the log explains a job, it must not end one). No fsync: a line lost in a crash of the host
    costs nothing but the line.
    """

    def __init__(self, path: Path, source: str, max_bytes: int = MAX_BYTES) -> None:
        self.path = Path(path)
        self.source = source
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._handle: Optional[BinaryIO] = None  # open while the log is written: a recovery of 16k ranks logs 16k orders
        self._size = 0
        self._failed = False

    def append(self, record: Record, at: Optional[float] = None) -> None:
        """Append ``record``, stamped with ``at`` (default: now, the wall clock)."""
        data = (encode(Event(time.time() if at is None else at, self.source, record)) + "\n").encode()
        with self._lock:
            try:
                if self._handle is None:
                    self._handle = open(self.path, "ab")
                    self._size = self._handle.tell()
                if self._size and self._size + len(data) > self.max_bytes:
                    self._handle.close()
                    self._handle = None
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                    self._handle = open(self.path, "ab")
                    self._size = 0
                self._handle.write(data)
                self._handle.flush()  # a line at a time: readers (--follow) see whole lines
                self._size += len(data)
            except OSError as error:
                if not self._failed:
                    self._failed = True
                    log.warning("cannot write the event log %s (%s); events are dropped", self.path, error)

    def close(self) -> None:
        """Close the file (a later :meth:`append` opens it again)."""
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None


def files(run_dir: Path) -> list[Path]:
    """The event files in ``run_dir``, each older generation first."""
    found: list[Path] = []
    for current in sorted(run_dir.glob("events*.jsonl")):
        older = current.with_name(current.name + ".1")
        found.extend(p for p in (older, current) if p.is_file())
    return found


def read_lines(lines: Iterable[str]) -> Iterator[Event]:
    """The events of ``lines``; a line that is not one (a torn last line) is logged and skipped."""
    for line in lines:
        if line.strip():
            try:
                yield decode(line)
            except EventError as error:
                log.debug("skipped an event line: %s", error)


def read(run_dir: Path) -> list[Event]:
    """Every event in ``run_dir``'s files, by time."""
    events: list[Event] = []
    for path in files(run_dir):
        with open(path, encoding="utf-8", errors="replace") as handle:
            events.extend(read_lines(handle))
    events.sort(key=lambda e: e.at)
    return events


def as_json(event: Event) -> dict[str, Any]:
    """``event`` as the dictionary its line holds."""
    return json.loads(encode(event))


class EventTail:
    """The events appended to ``run_dir``'s files since the last :meth:`poll` (for ``--follow``).

    Only complete lines are read; a file that shrank was rotated, and is read again from its start.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[Event]:
        """The new events, by time."""
        new: list[Event] = []
        for path in sorted(self.run_dir.glob("events*.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                if path.stat().st_size < offset:
                    offset = 0
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    data = handle.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1]
            self._offsets[path] = offset + len(complete)
            new.extend(read_lines(complete.decode("utf-8", "replace").splitlines()))
        new.sort(key=lambda e: e.at)
        return new
