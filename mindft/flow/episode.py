"""What one recovery is made of, as data: why each rank is part of it (:class:`Fault`), its rounds
and times (:class:`Episode`), and the names the shells use for the ladder's rungs and phases.

The rules that move an episode are :class:`~mindft.flow.ladder.Ladder`'s; the logs, the metrics
and the timeline read these names and records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mindft.flow.states import JobState
from mindft.protocol import ActionKind, FaultKind, OrderKind

_S = JobState
# The acknowledgement each waiting phase of a round collects from every rank.
ACK_FOR = {_S.PAUSING: ActionKind.PAUSE, _S.ROLLBACK: ActionKind.ROLLBACK, _S.RESUMING: ActionKind.RESUME}
# The timeout (a field of :class:`~mindft.config.Timeouts`) that bounds each waiting state.
PHASE_TIMEOUTS = {_S.STARTING: "register", _S.PAUSING: "pause", _S.REPAIRING: "repair",
                  _S.ROLLBACK: "rollback", _S.RESUMING: "resume"}
SCHEDULER = -1  # the "rank" :meth:`Fault.describe` is given for the scheduler's fault: a member without a rank
# The ladder's rungs, as logs and metrics name them: every rank rolls back in place; every worker
# restarts from the node agents' memory; the job fails and every rank dumps one step.
IN_PLACE, RESTART_ALL, DYING_GASP = "in_place", "restart_all", "dying_gasp"
RUNGS = (IN_PLACE, RESTART_ALL, DYING_GASP)


@dataclass
class Fault:
    """Why one rank is part of the current recovery, and what it still waits for."""

    kind: FaultKind
    step: int
    detail: str
    device_pending: bool = False   # until the device plugin reports the chip recovered
    process_pending: bool = False  # until a new incarnation registers
    left_at: float = -1.0          # when the rank was told to leave its device or killed (-1: neither)
    exited: bool = False           # its process is gone (after leaving, it is started when the device is back)
    kill_ordered: bool = False     # KillRank was emitted for its process
    leaving: bool = False          # told to leave its chip (LEAVE_DEVICE): its exit ends the leave phase
    start_ordered: bool = False    # StartRank was emitted for the process that left
    collateral: bool = False       # no fault of its own: restarted with every worker
    node: int = -1                 # its node was lost (-1: not)
    # Until its new process registers after its node was lost: the steps it can roll back to
    # (its replica's, restored on the new node; empty: none). None: its node was not lost.
    replica: Optional[tuple[int, ...]] = None
    restore_from: str = ""  # the keeper its new process's agent restores its replica from first ("": none)
    restore_rank: int = -1  # whose state that keeper serves, when not this rank's own (an elastic job's growth)

    def describe(self, rank: int) -> str:
        what = f"NODE LOST (node {self.node})" if self.node >= 0 else self.kind.name
        who = f"rank {rank} " if rank != SCHEDULER else ""
        return f"{who}{what} in step {self.step}" + (f" ({self.detail})" if self.detail else "")

    def pending_order(self) -> Optional[OrderKind]:
        """What its node agent must still do for it (None: nothing)."""
        if self.kill_ordered and not self.exited:
            return OrderKind.KILL
        return OrderKind.START if self.start_ordered and self.process_pending else None

    def repair_wait(self) -> str:
        """What a repair waits for of its rank, in the words of what is happening."""
        if self.device_pending:
            return "its chip is being reset"
        if self.node >= 0:
            return f"node {self.node} was lost; its new process has not registered"
        if self.kill_ordered and not self.exited:
            return "its process is being stopped"
        if self.start_ordered:
            return "its new process is starting: importing, joining MindSpore's cluster, restoring"
        return "its process is gone; a new one has not registered"


@dataclass
class Episode:
    """The recovery in progress (or the last one)."""

    round: int = 0
    started: float = 0.0
    fault_at: float = 0.0  # when its first fault happened, by the best time the job has (see :meth:`begin`)
    leave_ordered: float = -1.0  # the first order to leave a chip (-1: none)
    left: float = -1.0  # the last exit of a rank told to leave its chip (-1: none yet)
    faults: dict[int, Fault] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)  # ranks whose acknowledgement the phase still needs
    repair_step: int = -1
    restart_all: bool = False  # this recovery restarts every worker (the ladder's second rung)
    lost: set[int] = field(default_factory=set)  # ranks lost with their node, until their new process registers
    known: Optional[frozenset[int]] = None  # the steps every rank that reported this round holds (None: none did)
    scheduler: Optional[Fault] = None  # MindSpore's scheduler was lost in this recovery (SCHEDULER_LOST)
    seen: dict[tuple[int, FaultKind], int] = field(default_factory=dict)  # (rank, kind) → step, of its faults

    def begin(self, now: float, fault_at: Optional[float] = None) -> None:
        """A fault while the job trained: a recovery starts, with no fault yet. ``fault_at``: when
        the fault happened (None: ``now``), as its reporter said (a rank's report, its age) or as
        the job last heard of the rank (a silent or dead process died after its last message)."""
        self.faults.clear()
        self.seen.clear()
        self.scheduler = None
        self.started = now
        self.fault_at = now if fault_at is None else min(fault_at, now)
        self.leave_ordered = self.left = -1.0
        self.restart_all = False

    def detect_seconds(self) -> float:
        """From its first fault to the recovery's start: how long the job took to learn of it."""
        return self.started - self.fault_at

    def leave_seconds(self) -> Optional[float]:
        """From the first order to leave a chip to the last exit of a rank told to (None: no rank
        was told to leave its chip, or none exited)."""
        return self.left - self.leave_ordered if self.leave_ordered >= 0 and self.left >= 0 else None

    @property
    def rung(self) -> str:
        """The rung this recovery is on while it runs (the job's failure is :data:`DYING_GASP`)."""
        return RESTART_ALL if self.restart_all else IN_PLACE

    def new_round(self) -> None:
        self.round += 1
        self.known = None

    def know(self, held: tuple[int, ...]) -> None:
        """A rank reported the steps it holds this round (kept as a running intersection)."""
        self.known = frozenset(held) if self.known is None else self.known & frozenset(held)

    def summary(self) -> str:
        """Every fault of this recovery, the scheduler's first ("none": none)."""
        scheduler = [self.scheduler.describe(SCHEDULER)] if self.scheduler is not None else []
        return "; ".join(scheduler + [f.describe(r) for r, f in sorted(self.faults.items()) if not f.collateral]) \
            or "none"


def retried(kind: FaultKind) -> bool:
    """Whether a fault of ``kind`` is worth a recovery: not an exception from the training script,
    which would raise again in the same step."""
    return kind is not FaultKind.USER_ERROR


def phase_times(history: list[tuple[JobState, float]], since: float) -> dict[str, float]:
    """Seconds spent in each state from ``since`` on (for logs and benchmarks)."""
    marks = [(state, at) for state, at in history if at >= since]
    phases: dict[str, float] = {}
    for (state, at), (_, until) in zip(marks, marks[1:]):
        phases[state.value] = phases.get(state.value, 0.0) + (until - at)
    return phases
