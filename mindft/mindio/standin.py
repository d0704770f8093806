"""MindCluster's MindX as node 0's launcher plays it for MindIO's controller: the shell around its rules.

The rules (phases, transitions, deadlines) are :class:`mindft.flow.mindx.MindX`; this shell feeds
them MindIO's callbacks (from the controller's thread), the reset file's events (from the
watcher's thread) and, from a thread of its own, ticks with what it sees (the step gate, the
ranks' processes) at the deadlines the rules name; it carries out every decision they return.
"""
from __future__ import annotations

import logging
import threading
import time
from types import ModuleType
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from mindft.flow import mindx
from mindft.flow.effects import KillRank, StartRank
from mindft.mindio.gate import StepGate

log = logging.getLogger(__name__)

# How often the stand-in looks at the gate and the ranks' processes while a rule waits on them.
GATHER_POLL = 0.02


class MindxStandIn:
    """MindX for MindIO's controller (see :mod:`mindft.flow.mindx` for what it decides, and when).

    MindSpore answers the same way when it runs ARF without MindCluster (``TftHandle._mindx_stub``);
    MindCluster's clusterd does it for a device fault it sees. ``kill(rank, why)`` /
    ``start(rank, why)`` queue orders for the launcher; ``alive(rank)`` says whether the rank's
    process still runs.
    """

    def __init__(self, gate: StepGate, kill: Callable[[int, str], None], start: Callable[[int, str], None],
                 alive: Callable[[int], bool], leave_timeout: float = 30.0, gather_timeout: float = 60.0,
                 repair_timeout: float = 180.0) -> None:
        self._gate = gate
        self._kill, self._start, self._alive = kill, start, alive
        self._rules = mindx.MindX(leave_timeout=leave_timeout, gather_timeout=gather_timeout,
                                  repair_timeout=repair_timeout)
        self._api: Optional[ModuleType] = None
        self._lock = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._tick_loop, name="mindft-mindx", daemon=True)
        self._thread.start()

    # -- wiring ----------------------------------------------------------------------------------
    def callbacks(self) -> Dict[str, Callable[..., Any]]:
        """The four MindX callbacks for :class:`~mindft.mindio.controller.MindioController` (``mindx=``)."""
        return {"report_fault_ranks": self._on_fault_ranks, "report_stop_complete": self._on_stop_complete,
                "report_strategies": self._on_strategies, "report_result": self._on_result}

    def bind(self, api: ModuleType) -> None:
        """The started controller's module (its ``tft_notify_controller_*`` calls)."""
        self._api = api

    @property
    def failed(self) -> Optional[str]:
        """Why the job cannot go on (a chip failed, MindIO gave up), or None."""
        with self._lock:
            return self._rules.failed

    @property
    def phase(self) -> mindx.Phase:
        """Where the fault episode in MindIO's hands is."""
        with self._lock:
            return self._rules.phase

    @property
    def off_device(self) -> tuple:
        """Ranks whose chip is being reset (their process left or is leaving)."""
        with self._lock:
            return self._rules.off_device

    def close(self, timeout: float = 5.0) -> None:
        """Stop the stand-in's thread (the job is over); idempotent."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout)

    # -- inputs ----------------------------------------------------------------------------------
    def on_device_event(self, event: Any) -> None:
        """One event of :class:`mindft.device.watch.ResetWatcher`, a flow input (the watcher's thread)."""
        self._feed(mindx.Device(event, time.monotonic()))

    def _on_fault_ranks(self, errors: Mapping[int, int], codes: Any = None) -> None:
        self._feed(mindx.FaultRanks(dict(errors), time.monotonic()))

    def _on_stop_complete(self, code: int, message: str, errors: Mapping[int, int]) -> None:
        self._feed(mindx.StopComplete(code, message, dict(errors), time.monotonic()))

    def _on_strategies(self, errors: Mapping[int, int], strategies: Sequence[str]) -> None:
        self._feed(mindx.Strategies(dict(errors), tuple(strategies), time.monotonic()))

    def _on_result(self, code: int, message: str, errors: Mapping[int, int], strategy: str) -> None:
        self._feed(mindx.Result(code, message, strategy, time.monotonic()))

    def _feed(self, event: mindx.Input) -> None:
        """Apply ``event`` to the rules, wake the tick thread, carry out the decisions (outside the lock)."""
        with self._lock:
            if self._closing:
                return
            decisions = self._rules.handle(event)
            self._lock.notify_all()
        for decision in decisions:
            self._carry_out(decision)

    def _tick_loop(self) -> None:
        """Tick while a rule waits on the gate or a process, and at every deadline the rules name."""
        while True:
            with self._lock:
                if self._closing:
                    return
                wake = self._rules.next_wake()
                timeout = None if wake is None else max(0.0, wake - time.monotonic())
                if self._rules.polling:
                    timeout = GATHER_POLL if timeout is None else min(timeout, GATHER_POLL)
                if timeout is None or timeout > 0:
                    self._lock.wait(timeout)
                if self._closing:
                    return
                if wake is None and not self._rules.polling:
                    continue  # woken by an input that left nothing to wait on
                watched = self._rules.watched
            try:
                self._feed(mindx.Tick(time.monotonic(), self._gate.joined, self._gate.gathered(),
                                      frozenset(rank for rank in watched if self._alive(rank))))
            except Exception:  # the stand-in must outlive one bad look at the gate or the launcher
                log.exception("MindX stand-in: a tick failed")

    # -- decisions -------------------------------------------------------------------------------
    def _carry_out(self, decision: mindx.Decision) -> None:
        try:
            self._perform(decision)
        except Exception:  # one failed order must not stop the ones after it
            log.exception("MindX stand-in: carrying out %r failed", decision)

    def _perform(self, decision: mindx.Decision) -> None:
        if isinstance(decision, mindx.StopTrain):
            self._notify("tft_notify_controller_stop_train", dict(decision.ranks))
        elif isinstance(decision, mindx.ConfirmRanks):
            self._notify("tft_notify_controller_on_global_rank", dict(decision.ranks), 1)
        elif isinstance(decision, mindx.ChangeStrategy):
            self._notify("tft_notify_controller_change_strategy", decision.strategy)
        elif isinstance(decision, mindx.ElegantDump):
            self._notify("tft_notify_controller_dump")
        elif isinstance(decision, mindx.HoldGate):
            self._gate.hold()
        elif isinstance(decision, mindx.ReleaseGate):
            self._gate.release()
        elif isinstance(decision, mindx.LeaveGate):
            self._gate.leave([decision.rank])
        elif isinstance(decision, mindx.RejoinGate):
            self._gate.rejoin(decision.rank)
        elif isinstance(decision, KillRank):
            self._kill(decision.rank, decision.reason)
        elif isinstance(decision, StartRank):
            self._start(decision.rank, decision.reason)
        elif isinstance(decision, mindx.Fail):
            log.error("MindX stand-in: %s; every rank writes its dying-gasp checkpoint", decision.reason)
        else:
            raise TypeError(f"not a decision of the MindX stand-in: {decision!r}")

    def _notify(self, name: str, *args: Any) -> None:
        api = self._api
        if api is None:
            log.error("MindX stand-in: %s before MindIO's controller started; ignored", name)
            return
        code = getattr(api, name)(*args)
        if code != 0:
            log.error("MindIO's controller refused %s%r (code %s)", name, args, code)
