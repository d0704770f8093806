"""The timeline of every recovery, from a job's event log (:mod:`mindft.observe.events`). Pure: no I/O.

A recovery begins when the job leaves NORMAL for PAUSING and ends when it is NORMAL again
(recovered) or FAILED. Its marks are what happened in it, in order (the fault, the ladder's
decision, the pause, the kills and exits, the process starts, the restore, the resume); its
phases are the seconds it spent in each recovery state, summed over its rounds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from mindft.observe.events import (ClusterFormed, ControllerFollowed, Event, FaultSeen, JobFinished, JobMoved,
                                   LadderDecision, NodeGiven, OrderSent, ProcessExitRecord, ProcessStartRecord, RankSlow,
                                   TookCommand, WorldResized)
from mindft.flow.episode import DYING_GASP, IN_PLACE, RESTART_ALL
from mindft.flow.goodput import PRODUCTIVE

RECOVERY_STATES = ("PAUSING", "REPAIRING", "ROLLBACK", "RESUMING")
PHASE_NAMES = {"PAUSING": "pause", "REPAIRING": "repair", "ROLLBACK": "rollback", "RESUMING": "resume"}
# What reaching each state says, in a timeline.
_REACHED = {"REPAIRING": "every rank paused", "ROLLBACK": "every rank holds the rollback step (repaired)",
            "RESUMING": "every rank restored the rollback step", "NORMAL": "training resumed",
            "FAILED": "the job failed"}
# A worker's exit at most this long before a recovery began is the fault it began for (the agent's
# report reaches the controller in milliseconds; this leaves room for a loaded host).
FAULT_LEAD = 5.0
_RUNGS = {IN_PLACE: "ladder: every rank rolls back in place",
          RESTART_ALL: "ladder: every worker restarts from the agents' memory",
          DYING_GASP: "ladder: the job fails, every rank writes its dying gasp"}


@dataclass
class Recovery:
    """One recovery: ``marks`` are (epoch seconds, what happened); ``outcome`` is ``recovered``,
    ``failed`` or ``in progress``; ``phases``: seconds per phase (detect: from a process's exit to
    the controller's pause, then pause, repair, rollback, resume)."""

    start: float
    end: Optional[float] = None
    outcome: str = "in progress"
    rung: str = IN_PLACE
    faults: list[FaultSeen] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> Optional[float]:
        """Seconds from the fault to the end (None while in progress)."""
        return None if self.end is None else self.end - self.start


def describe(event: Event) -> str:
    """One line for ``event`` (without its time)."""
    r = event.record
    if isinstance(r, JobMoved):
        return f"{r.from_state} → {r.to_state}: {r.reason}"
    if isinstance(r, FaultSeen):
        who = "MindSpore's scheduler" if r.rank < 0 else f"rank {r.rank}"
        what = "restarts with every worker" if r.collateral else f"{r.fault} at step {r.step}"
        return f"fault: {who} {what}" + (f" (node {r.node} lost)" if r.node >= 0 else "") + \
            (f": {r.reason}" if r.reason else "")
    if isinstance(r, LadderDecision):
        return f"{_RUNGS.get(r.rung, 'ladder: ' + r.rung)} ({r.reason})"
    if isinstance(r, OrderSent):
        pid = f" (pid {r.pid})" if r.pid else ""
        return f"order: {r.order} rank {r.rank}{pid}: {r.reason}"
    if isinstance(r, NodeGiven):
        return f"node {r.node} given to a warm spare (adoption {r.adoption}): {r.reason}"
    if isinstance(r, WorldResized):
        return f"world resized to {r.world_size} rank(s) (term {r.term}, at step {r.step}): {r.reason}"
    if isinstance(r, ControllerFollowed):
        return (f"{event.source}: the controller at {r.old} said nothing for {r.silent:.1f} s; following the "
                f"standby at {r.new} (term {r.term}{', this node' if r.here else ''})")
    if isinstance(r, TookCommand):
        return f"the standby controller on node {r.node} took command: term {r.old_term} → {r.term} ({r.reason})"
    if isinstance(r, RankSlow):
        return r.reason
    if isinstance(r, ProcessStartRecord):
        who = f"rank {r.rank}" if r.role == "worker" else r.role
        how = "warm" if r.warm else "cold"
        return f"{event.source}: {who} started (pid {r.pid}, {how}" + \
            (f", restart {r.restarts}" if r.role == "worker" else "") + ")" + (f": {r.detail}" if r.detail else "")
    if isinstance(r, ProcessExitRecord):
        who = f"rank {r.rank}" if r.role == "worker" else r.role
        return f"{event.source}: {who} (pid {r.pid}) {_how(r)}"
    if isinstance(r, ClusterFormed):
        return f"{event.source}: MindSpore's cluster formed (scheduler pid {r.pid})"
    if isinstance(r, JobFinished):
        return f"job finished: exit code {r.exit_code}: {r.reason}"
    return event.kind  # pragma: no cover - every record kind is above


def goodput_text(seconds: dict[str, float]) -> str:
    """A job's wall time by bucket (:mod:`mindft.flow.goodput`) in one line: the productive share, then
    the badput buckets that hold any."""
    wall = sum(seconds.values())
    productive = seconds.get(PRODUCTIVE, 0.0)
    rest = ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items() if name != PRODUCTIVE and value >= 0.05)
    share = 100.0 * productive / wall if wall > 0 else 0.0
    return f"{share:.1f}% of {wall:.1f} s productive ({productive:.1f} s)" + (f"; the rest: {rest}" if rest else "")


def _how(record: ProcessExitRecord) -> str:
    return f"killed by signal {-record.code}" if record.code < 0 else f"exit code {record.code}"


def recoveries(events: Iterable[Event]) -> list[Recovery]:
    """The recoveries in ``events`` (sorted by time), oldest first."""
    found: list[Recovery] = []
    current: Optional[Recovery] = None
    state, since = "", 0.0
    exits: dict[int, Event] = {}  # rank → its last exit while the job trained (the fault, if it is one)
    groups: dict[str, list[tuple[float, str]]] = {}  # of the current recovery: kills, exits, starts
    for event in events:
        r = event.record
        if current is None and isinstance(r, ProcessExitRecord) and r.role == "worker":
            exits[r.rank] = event
        if isinstance(r, JobMoved):
            if current is not None and state in PHASE_NAMES:
                name = PHASE_NAMES[state]
                current.phases[name] = current.phases.get(name, 0.0) + (event.at - since)
            if current is None and r.to_state == "PAUSING":
                current = Recovery(event.at)
                if r.detect >= 0:  # the controller's own figure: the one its log says
                    current.phases["detect"], current.start = r.detect, event.at - r.detect
                found.append(current)
                groups = {}
            state, since = r.to_state, event.at
            if current is None:
                continue
            if r.to_state in _REACHED and r.from_state != r.to_state:
                current.marks.append((event.at, _REACHED[r.to_state]))
            if r.to_state in ("NORMAL", "FAILED"):
                current.end, current.outcome = event.at, "recovered" if r.to_state == "NORMAL" else "failed"
                _close(current, groups)
                current = None
            continue
        if current is None:
            if isinstance(r, LadderDecision) and found and found[-1].outcome == "failed" and found[-1].rung != r.rung:
                # The controller logs the last rung after the move to FAILED that ended the recovery.
                found[-1].rung = r.rung
                found[-1].marks.append((event.at, _RUNGS.get(r.rung, "ladder: " + r.rung)))
            continue
        if isinstance(r, FaultSeen):
            current.faults.append(r)
            if not r.collateral:
                current.marks.append((event.at, describe(event)))
            exit_ = exits.pop(r.rank, None)
            if exit_ is not None and not r.collateral and current.start - exit_.at <= FAULT_LEAD:
                # The node agent saw the process exit before the controller heard of it; a log
                # without the controller's figure takes that exit as the fault.
                if "detect" not in current.phases:
                    current.phases["detect"] = current.start - exit_.at
                    current.start = exit_.at
                groups.setdefault("exit", []).append((exit_.at, f"rank {r.rank} ({_how(exit_.record)})"))
        elif isinstance(r, LadderDecision):
            current.rung = r.rung
            current.marks.append((event.at, _RUNGS.get(r.rung, "ladder: " + r.rung)))
        elif isinstance(r, OrderSent) and r.order == "kill":
            groups.setdefault("kill", []).append((event.at, f"rank {r.rank}"))
        elif isinstance(r, ProcessExitRecord) and r.role == "worker":
            groups.setdefault("exit", []).append((event.at, f"rank {r.rank} ({_how(r)})"))
        elif isinstance(r, ClusterFormed):
            current.marks.append((event.at, "MindSpore's cluster formed (init() returns on the ranks)"))
        elif isinstance(r, NodeGiven):
            current.marks.append((event.at, f"node {r.node} given to a warm spare"))
        elif isinstance(r, WorldResized):
            current.marks.append((event.at, f"world resized to {r.world_size} rank(s) without node "
                                            f"{', '.join(map(str, r.lost))}"))
        elif isinstance(r, ProcessStartRecord) and r.role == "scheduler":
            current.marks.append((event.at, "new MindSpore scheduler started"))
        elif isinstance(r, ProcessStartRecord):
            groups.setdefault("start", []).append((event.at, f"rank {r.rank} ({'warm' if r.warm else 'cold'})"))
    if current is not None:
        _close(current, groups)
    return found


# Per group of a recovery: (one of them, the first of several, the last of several).
_GROUPS = {"kill": ("kill ordered: {}", "first kill ordered: {}", "last of {n} kills ordered: {}"),
           "exit": ("worker exited: {}", "first worker exited: {}", "last of {n} worker exits: {}"),
           "start": ("worker started: {}", "first worker started: {}", "last of {n} worker starts: {}")}


def _close(recovery: Recovery, groups: dict[str, list[tuple[float, str]]]) -> None:
    """Add the recovery's kills, exits and starts to its marks (the first and last of several), in order."""
    for name, marks in groups.items():
        one, first, last = _GROUPS[name]
        marks.sort()
        if len(marks) == 1:
            recovery.marks.append((marks[0][0], one.format(marks[0][1])))
        else:
            recovery.marks.append((marks[0][0], first.format(marks[0][1])))
            recovery.marks.append((marks[-1][0], last.format(marks[-1][1], n=len(marks))))
    recovery.marks.sort(key=lambda mark: mark[0])


def render(recovery: Recovery, number: int = 1, origin: Optional[float] = None) -> list[str]:
    """The lines of one recovery's timeline: a heading, (seconds after ``origin``, default its
    start) and what happened, then its phases and total."""
    origin = recovery.start if origin is None else origin
    first = next((f for f in recovery.faults if not f.collateral), recovery.faults[0] if recovery.faults else None)
    what = "a fault" if first is None else f"{first.fault} on " + ("MindSpore's scheduler" if first.rank < 0
                                                                    else f"rank {first.rank}")
    total = recovery.total
    ending = f"{recovery.outcome} in {total:.2f}s" if total is not None else recovery.outcome
    lines = [f"recovery {number}: {what}; {recovery.rung.replace('_', ' ')}; {ending}",
             "  seconds  after the fault"]
    lines += [f"  {at - origin:7.2f}  {label}" for at, label in recovery.marks]
    if recovery.phases:
        lines.append("  phases: " + ", ".join(f"{name} {recovery.phases[name]:.2f}s"
                                              for name in ("detect", *PHASE_NAMES.values()) if name in recovery.phases)
                     + (f"; total {total:.2f}s" if total is not None else ""))
    return lines
