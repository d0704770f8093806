"""MindX's rules for MindIO's controller, as node 0's launcher plays them: phases, transitions, deadlines.

MindIO's controller, with MindX's four callbacks registered, asks MindX at every fault: it
reports the fault ranks, waits for ``stop_train``, reports the stop complete, waits for the
confirmed fault ranks, offers strategies (``retry`` = UCE repair in place, ``recover`` = ARF: the
faulty processes are restarted and repaired from a replica, ``dump``, ``exit``) and reports the
result. :class:`MindX` answers each report and feeds MindIO the device plugin's reset file:

* ``unrecovered`` for rank R: once every rank asked the step gate, the gate holds every rank at
  one common step (``gather_timeout``); then ``stop_train({R: process error})`` (MindIO pauses the
  healthy ranks) and R is told to leave (it exits, its snapshots stay in the node agent's memory;
  killed after ``leave_timeout``); the strategy is ``recover`` (MindIO's ARF), so MindIO waits
  for R's new process.
* ``recovered`` for R: once R's old process is gone, R is started again; the new process rejoins
  through ARF; MindIO repairs and rolls every rank back to the gathered step.
* ``failed``/``isolate`` (or no ``recovered`` within ``repair_timeout``): the strategy becomes
  ``dump``: MindIO has a live rank save, then orders every live rank to exit.
* A fault a rank reports itself (UCE) is answered ``retry``; a lost process (killed, not on a
  reset chip) ``dump``: mindft-launch does not restart it on this backend.
* Volcano's graceful exit before any fault: the gate holds and MindIO dumps ("elegant dump").

Pure: every input carries the time it happened (``now``) and what the shell saw (the gate, the
processes); every decision comes back as a value the shell (:mod:`mindft.mindio.standin`)
carries out in order. One fault episode is in MindIO's hands at a time (:class:`Phase`); each
rank whose chip is reset goes through :class:`Reset`.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from mindft.flow.effects import KillRank, StartRank
from mindft.flow.inputs import DeviceFailed, DeviceFaulty, DeviceInput, DeviceRecovered, StopJob
from mindft.flow.states import IllegalTransition

log = logging.getLogger(__name__)

# MindIO's error-type codes in a MindX fault-rank map (controller.cpp).
MINDX_UCE_ERROR, MINDX_PROCESS_ERROR = 0, 1
# After its chip is recovered, how much longer than ``leave_timeout`` a rank's old process is
# waited for before the rank is started anyway (the plugin itself waits for the process to go).
START_GRACE = 10.0
REPAIR_STRATEGIES = ("retry", "recover")
ENDING_STRATEGIES = ("dump", "exit")


class Phase(str, enum.Enum):
    """Where one fault episode is, seen from MindX's side of MindIO's controller."""

    IDLE = "idle"              # training; no fault being handled
    STOPPING = "stopping"      # stop_train sent (or asked for): MindIO pauses every healthy rank
    CHOOSING = "choosing"      # stop complete, fault ranks confirmed: MindIO offers its strategies
    REPAIRING = "repairing"    # a strategy chosen (retry, recover = ARF); waiting for its result
    ENDED = "ended"            # MindIO dumps or exits: the job is over


class Step(str, enum.Enum):
    """What moves an episode from one :class:`Phase` to the next."""

    STOP = "stop"          # a fault: stop_train sent (MindIO's own report, or a chip's reset)
    STOPPED = "stopped"    # MindIO stopped the ranks: it offers strategies next
    REPAIR = "repair"      # a repair strategy chosen (retry, recover)
    REPAIRED = "repaired"  # MindIO reports the repair done
    END = "end"            # dump or exit chosen, or MindIO could not stop or repair: the job is over


_P, _T = Phase, Step
PHASE_TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (_P.IDLE, _T.STOP): _P.STOPPING,
    (_P.STOPPING, _T.STOPPED): _P.CHOOSING,
    (_P.CHOOSING, _T.STOPPED): _P.CHOOSING,     # a repeated report changes nothing
    (_P.CHOOSING, _T.REPAIR): _P.REPAIRING,
    (_P.REPAIRING, _T.REPAIR): _P.REPAIRING,
    (_P.REPAIRING, _T.REPAIRED): _P.IDLE,
    **{(phase, _T.END): _P.ENDED for phase in Phase},
}


def next_phase(phase: Phase, step: Step) -> Phase:
    """The phase ``step`` leads to from ``phase``; :class:`IllegalTransition` if the table has none."""
    target = PHASE_TRANSITIONS.get((phase, step))
    if target is None:
        allowed = ", ".join(sorted(s.value for (p, s) in PHASE_TRANSITIONS if p is phase))
        raise IllegalTransition(f"MindX stand-in: no transition from {phase.value} on {step.value}; "
                                f"allowed in {phase.value}: {allowed}")
    return target


class Reset(str, enum.Enum):
    """Where one rank whose chip the device plugin resets is."""

    GATHERING = "gathering"  # the gate holds every rank at one step (once every rank asked it)
    QUEUED = "queued"        # gathered; waits for the episode MindIO is in, if any, to finish
    LEAVING = "leaving"      # told to leave its chip; killed if still there after leave_timeout
    LEFT = "left"            # its process is gone; waits for the chip to be recovered
    STARTING = "starting"    # its process is gone (or killed) and the chip is back: started


RESET_TRANSITIONS: dict[Reset, frozenset[Reset]] = {
    Reset.GATHERING: frozenset({Reset.QUEUED}),
    Reset.QUEUED: frozenset({Reset.LEAVING}),
    Reset.LEAVING: frozenset({Reset.LEFT, Reset.STARTING}),
    Reset.LEFT: frozenset({Reset.STARTING}),
    Reset.STARTING: frozenset(),
}
# A rank's reset ends (it leaves the table) when it is started again.
_ENDS_FROM = frozenset({Reset.STARTING})
_WATCHED = frozenset({Reset.LEAVING, Reset.STARTING})  # a tick must say whether their process runs


@dataclass
class RankReset:
    """One rank in a hot reset: its :class:`Reset` state and the deadline of that state."""

    rank: int
    state: Reset
    deadline: float                  # of the current state (gather, queue, leave, start)
    repair_deadline: float = float("inf")  # the chip must be recovered by then (from the leave order)
    chip_back: bool = False          # recovered before the rank left: it still leaves, then starts


# ---- inputs: each carries ``now`` ----------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """A reset-file event in the flow's vocabulary (:data:`mindft.flow.effects.DeviceInput`)."""

    event: DeviceInput
    now: float


@dataclass(frozen=True)
class FaultRanks:
    """MindIO's ``report_fault_ranks``: rank → error type (:data:`MINDX_UCE_ERROR`, ...)."""

    errors: Mapping[int, int]
    now: float


@dataclass(frozen=True)
class StopComplete:
    """MindIO's ``report_stop_complete``: ``code`` 0 once every rank stopped."""

    code: int
    message: str
    errors: Mapping[int, int]
    now: float


@dataclass(frozen=True)
class Strategies:
    """MindIO's ``report_strategies``: what it can do for ``errors``."""

    errors: Mapping[int, int]
    offered: tuple[str, ...]
    now: float


@dataclass(frozen=True)
class Result:
    """MindIO's ``report_result`` of ``strategy``: ``code`` 0 when it worked."""

    code: int
    message: str
    strategy: str
    now: float


@dataclass(frozen=True)
class Tick:
    """What the shell saw at ``now``: whether every rank asked the step gate, the step every rank
    waits at (None: not gathered), and which of the :attr:`MindX.watched` ranks' processes run."""

    now: float
    joined: bool = True
    gathered: Optional[int] = None
    running: frozenset[int] = frozenset()


Input = Union[Device, FaultRanks, StopComplete, Strategies, Result, Tick]


# ---- decisions ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class StopTrain:
    """Tell MindIO's controller to stop the job for ``ranks`` (``tft_notify_controller_stop_train``)."""

    ranks: Mapping[int, int]


@dataclass(frozen=True)
class ConfirmRanks:
    """Confirm the fault ranks to MindIO (``tft_notify_controller_on_global_rank``)."""

    ranks: Mapping[int, int]


@dataclass(frozen=True)
class ChangeStrategy:
    """Tell MindIO which strategy to run (``tft_notify_controller_change_strategy``)."""

    strategy: str


@dataclass(frozen=True)
class ElegantDump:
    """Ask MindIO to dump with no fault under way (``tft_notify_controller_dump``)."""


@dataclass(frozen=True)
class HoldGate:
    """Let no rank start a step beyond the newest any rank finished: gather them at one step."""


@dataclass(frozen=True)
class ReleaseGate:
    """End the hold: every rank trains on."""


@dataclass(frozen=True)
class LeaveGate:
    """Answer ``rank``'s next gate request with "leave": its chip is reset, its process must exit."""

    rank: int


@dataclass(frozen=True)
class RejoinGate:
    """``rank`` starts again (a new process): the gate serves it normally."""

    rank: int


@dataclass(frozen=True)
class Fail:
    """The job cannot go on: every rank writes its dying-gasp checkpoint (MindIO dumps)."""

    reason: str


ToMindio = Union[StopTrain, ConfirmRanks, ChangeStrategy, ElegantDump]
ToGate = Union[HoldGate, ReleaseGate, LeaveGate, RejoinGate]
Decision = Union[ToMindio, ToGate, KillRank, StartRank, Fail]


@dataclass
class MindX:
    """The rules: :meth:`handle` one input, get the decisions; :meth:`next_wake` says when to tick."""

    leave_timeout: float = 30.0
    gather_timeout: float = 60.0
    repair_timeout: float = 180.0
    phase: Phase = Phase.IDLE
    strategy: Optional[str] = None
    failed: Optional[str] = None  # why the job cannot go on (set at the latest when it ENDED)
    holding: bool = False         # the gate holds the ranks (HoldGate given, ReleaseGate not since)
    resets: dict[int, RankReset] = field(default_factory=dict)

    @property
    def off_device(self) -> tuple[int, ...]:
        """Ranks whose chip is being reset (their process left, is leaving or is about to)."""
        return tuple(sorted(self.resets))

    @property
    def watched(self) -> tuple[int, ...]:
        """Ranks whose process liveness the next :class:`Tick` must report in ``running``."""
        return tuple(sorted(r for r, reset in self.resets.items() if reset.state in _WATCHED))

    @property
    def polling(self) -> bool:
        """Whether a rule waits on what only a :class:`Tick` shows (the gate, a process going)."""
        return any(self._polls(reset) for reset in self.resets.values())

    def _polls(self, reset: RankReset) -> bool:
        if reset.state is Reset.STARTING:
            return self.failed is None
        return reset.state in (Reset.GATHERING, Reset.LEAVING)

    def next_wake(self) -> Optional[float]:
        """The earliest deadline a :class:`Tick` must be given at (None: none pending)."""
        times = [t for reset in self.resets.values() for t in self._deadlines(reset)]
        return min(times) if times else None

    def _deadlines(self, reset: RankReset) -> list[float]:
        own = [reset.deadline] if self._polls(reset) or reset.state is Reset.QUEUED else []
        waits_for_chip = reset.state in (Reset.LEAVING, Reset.LEFT, Reset.STARTING)
        return own + ([reset.repair_deadline] if waits_for_chip and self.failed is None else [])

    # ---- the one entry point ---------------------------------------------------------------------

    def handle(self, event: Input) -> list[Decision]:
        """Apply one input; the decisions to carry out, in order."""
        if isinstance(event, Tick):
            out = self._observe(event)
        elif isinstance(event, Device):
            out = self._device(event.event, event.now)
        elif isinstance(event, FaultRanks):
            out = self._fault_ranks(event)
        elif isinstance(event, StopComplete):
            out = self._stop_complete(event)
        elif isinstance(event, Strategies):
            out = self._strategies(event)
        elif isinstance(event, Result):
            out = self._result(event)
        else:
            raise TypeError(f"not an input of the MindX stand-in: {event!r}")
        return out + self._advance(event.now)

    # ---- transitions -----------------------------------------------------------------------------

    def _move(self, step: Step) -> None:
        target = next_phase(self.phase, step)
        if target is not self.phase:
            log.info("MindX stand-in: %s -> %s", self.phase.value, target.value)
        self.phase = target

    def _set(self, reset: RankReset, state: Reset, deadline: float) -> None:
        if state not in RESET_TRANSITIONS[reset.state]:
            raise IllegalTransition(f"MindX stand-in: rank {reset.rank}'s reset cannot go from "
                                    f"{reset.state.value} to {state.value}")
        reset.state, reset.deadline = state, deadline

    def _end_reset(self, reset: RankReset) -> list[Decision]:
        if reset.state not in _ENDS_FROM:
            raise IllegalTransition(f"MindX stand-in: rank {reset.rank}'s reset cannot end while "
                                    f"{reset.state.value}")
        del self.resets[reset.rank]
        if self.resets or not self.holding:
            return []
        self.holding = False
        return [ReleaseGate()]

    def _with_off(self, errors: Mapping[int, int]) -> dict[int, int]:
        """MindIO's fault ranks plus every rank on a chip being reset (a process error for MindIO)."""
        return {**{int(r): int(t) for r, t in dict(errors).items()},
                **{r: MINDX_PROCESS_ERROR for r in self.resets}}

    # ---- the device plugin ---------------------------------------------------------------------

    def _device(self, event: DeviceInput, now: float) -> list[Decision]:
        if isinstance(event, DeviceFaulty):
            if event.rank in self.resets or self.phase is Phase.ENDED:
                return []
            log.warning("device plugin: rank %d's chip is faulty (%s, policy %s): hot reset through MindIO",
                        event.rank, event.error_code, event.policy)
            self._begin_reset(event.rank, now)
            return []
        if isinstance(event, DeviceRecovered):
            return self._recovered(event.rank, now)
        if isinstance(event, DeviceFailed):
            return self._fail(f"rank {event.rank}'s chip failed the hot reset ({event.reason})", event.rank, now)
        if isinstance(event, StopJob):
            return self._fail(event.reason, None, now, graceful=True)
        log.warning("reset file: %s is not acted on with MINDFT_BACKEND=mindio (mindft's own backend "
                    "rolls every rank back on it)", type(event).__name__)
        return []

    def _begin_reset(self, rank: int, now: float) -> None:
        self.resets[rank] = RankReset(rank, Reset.GATHERING, now + self.gather_timeout)

    def _recovered(self, rank: int, now: float) -> list[Decision]:
        reset = self.resets.get(rank)
        if reset is None or reset.state is Reset.STARTING:
            return []
        if reset.state in (Reset.GATHERING, Reset.QUEUED, Reset.LEAVING):
            # MindIO counts it as a process error (or will): it leaves as planned, then starts again.
            log.warning("rank %d's chip was recovered before its process left it", rank)
            reset.chip_back = True
            return []
        self._set(reset, Reset.STARTING, now + self.leave_timeout + START_GRACE)
        return []

    def _fail(self, reason: str, rank: Optional[int], now: float, graceful: bool = False) -> list[Decision]:
        if self.failed is not None:
            return []
        self.failed = reason
        out: list[Decision] = [Fail(reason)]
        if self.phase is Phase.REPAIRING and self.strategy == "recover":
            out.append(ChangeStrategy("dump"))  # MindIO leaves its ARF wait
        elif self.phase is Phase.IDLE and graceful:
            if not self.holding:
                self.holding = True
                out.append(HoldGate())
            out.append(ElegantDump())  # MindIO's own "elegant dump"
        elif self.phase is Phase.IDLE and rank is not None and rank not in self.resets:
            self._begin_reset(rank, now)  # its ranks are gathered and stopped, then MindIO dumps
        # STOPPING / CHOOSING: the strategy chosen next is dump.
        return out

    # ---- MindIO's controller -------------------------------------------------------------------

    def _fault_ranks(self, event: FaultRanks) -> list[Decision]:
        if self.phase is not Phase.IDLE:
            return []  # our own stop_train, or MindIO's second report of an episode under way
        self._move(Step.STOP)
        log.warning("MindIO reports fault ranks %s; stopping the job", dict(event.errors))
        return [StopTrain(self._with_off(event.errors))]

    def _stop_complete(self, event: StopComplete) -> list[Decision]:
        if event.code != 0:
            log.error("MindIO could not stop the job (%s: %s)", event.code, event.message)
            self._move(Step.END)
            self.failed = self.failed or f"MindIO could not stop the job: {event.message}"
            return []
        self._move(Step.STOPPED)
        return [ConfirmRanks(self._with_off(event.errors))]

    def _strategies(self, event: Strategies) -> list[Decision]:
        offered = list(event.offered)
        ending = "dump" if "dump" in offered else "exit"
        errors = dict(event.errors)
        if self.failed is not None:
            choice = ending
        elif any(int(r) in self.resets for r in errors):
            choice = "recover" if "recover" in offered else ending
            if choice != "recover":
                log.error("MindIO offers %s, not ARF (recover): it cannot take the reset chip's ranks "
                          "back; falling back to %s", offered, choice)
        elif "retry" in offered:
            choice = "retry"
        else:
            choice = ending
        self._move(Step.END if choice in ENDING_STRATEGIES else Step.REPAIR)
        self.strategy = choice
        if choice in ENDING_STRATEGIES:
            self.failed = self.failed or f"MindIO cannot repair ranks {sorted(errors)} ({choice})"
        log.warning("MindIO offers %s for fault ranks %s: %s", offered, errors, choice)
        return [ChangeStrategy(choice)]

    def _result(self, event: Result) -> list[Decision]:
        if event.code == 0:
            log.warning("MindIO: %s (%s)", event.message, event.strategy)
            if self.phase is Phase.REPAIRING:
                self._move(Step.END if self.failed is not None else Step.REPAIRED)
            return []
        log.error("MindIO: %s (code %s, strategy %s); asking for a dump", event.message, event.code,
                  event.strategy)
        self._move(Step.END)
        self.failed = self.failed or f"MindIO's {event.strategy} failed: {event.message}"
        self.strategy = "dump"
        return [ChangeStrategy("dump")]

    # ---- what only time and the shell's eyes move ------------------------------------------------

    def _observe(self, tick: Tick) -> list[Decision]:
        """Rules that need what the shell saw: the gate, the processes."""
        out: list[Decision] = []
        for reset in list(self.resets.values()):
            if reset.state is Reset.GATHERING:
                out += self._gather(reset, tick)
            elif reset.state is Reset.LEAVING:
                gone = reset.rank not in tick.running
                if gone or tick.now >= reset.deadline:
                    if reset.chip_back:  # nothing to wait for: started once its process is gone
                        self._set(reset, Reset.STARTING, tick.now + self.leave_timeout + START_GRACE)
                    else:
                        self._set(reset, Reset.LEFT, reset.deadline)
                    if not gone:
                        out.append(KillRank(reset.rank, 0, f"did not leave its chip within {self.leave_timeout:g} s "
                                            f"(the device plugin resets a chip only once its processes are gone)",
                                            restart=False))
            if reset.state is Reset.STARTING and self.failed is None:  # also one that just left
                if reset.rank not in tick.running or tick.now >= reset.deadline:
                    out.append(RejoinGate(reset.rank))
                    out += self._end_reset(reset)
                    out.append(StartRank(reset.rank, "its chip was reset (recovered)"))
        return out

    def _gather(self, reset: RankReset, tick: Tick) -> list[Decision]:
        late = tick.now >= reset.deadline
        if self.holding and tick.gathered is not None:
            log.warning("every rank waits after step %d; rank %d leaves its chip", tick.gathered, reset.rank)
        elif late:
            log.error("the ranks did not gather at one step within %.0f s; stopping them where they are",
                      self.gather_timeout)
        else:
            if self.holding or not tick.joined:
                return []  # MindIO knows no rank before it started; hold once every rank asked the gate
            self.holding = True
            return [HoldGate()]
        self._set(reset, Reset.QUEUED, tick.now + self.repair_timeout)
        out: list[Decision] = []
        if not self.holding:
            self.holding = True
            out.append(HoldGate())
        return out

    def _advance(self, now: float) -> list[Decision]:
        """Rules that need only the phase and the time: a queued reset goes ahead, a chip is given up."""
        out: list[Decision] = []
        for reset in list(self.resets.values()):
            if reset.state is Reset.QUEUED:
                free = self.phase in (Phase.IDLE, Phase.ENDED, Phase.STOPPING) or self.failed is not None
                if free or now >= reset.deadline:
                    out += self._leave(reset, now)
            elif (reset.state in (Reset.LEAVING, Reset.LEFT, Reset.STARTING) and self.failed is None
                  and now >= reset.repair_deadline):
                out += self._fail(f"rank {reset.rank}'s chip was not recovered within {self.repair_timeout:g} s",
                                  reset.rank, now)
        return out

    def _leave(self, reset: RankReset, now: float) -> list[Decision]:
        """Stop the job through MindIO (unless an episode already does) and send the rank off its chip."""
        out: list[Decision] = []
        if self.phase is Phase.IDLE:  # one episode at a time: a fault already in MindIO's hands goes on
            self._move(Step.STOP)
            out.append(StopTrain({r: MINDX_PROCESS_ERROR for r in self.resets}))
        self._set(reset, Reset.LEAVING, now + self.leave_timeout)
        reset.repair_deadline = now + self.repair_timeout
        return out + [LeaveGate(reset.rank)]
