"""MindIO's coordinator for the rank engine: MindIO's processor (:class:`MindioRank`) and the step gate.

:class:`MindioLoop` is the :class:`~mindft.rank.loop.Coordinator` of a rank engine under
``MINDFT_BACKEND=mindio`` (:class:`mindft.mindspore._mindio_session.MindioSession`): MindIO TFT
decides, the engine's snapshots do the work.

* every step: the step gate (``MINDFT_STEP_GATE``, served by node 0's mindft-launch: no rank
  starts step k + 1 before every rank finished k, as an all-reduce would), then
  ``tft_start_updating_os(k)``; after the step the snapshot of k is captured and completed, then
  ``tft_end_updating_os(k)`` tells MindIO the step exists;
* an exception inside a step is reported to MindIO (``tft_report_error``) and the training thread
  waits in ``tft_wait_next_action``; a healthy rank that MindIO stops leaves its step or the gate
  and acknowledges; MindIO's ``repair`` / ``rollback`` handlers restore this rank's own snapshot
  of the repair step r. The faulty rank never finished r when r is the step it faulted in: it
  restores its newest step below r and replays the difference (mindft's ranks restore their own
  state; MindIO's repair source, a replica's device memory, is not copied);
* a hot reset (node 0's launcher reads the reset file and plays MindX for MindIO): the step gate
  answers ``leave`` to the ranks on the chip; they exit 6 with their snapshots in the node
  agent's memory (``MINDFT_STATE_DIR``) and, once restarted, rejoin through MindIO's ARF
  (:meth:`MindioRank.rejoin`) and restore the repair step from that memory;
* a rank killed otherwise is not restarted: MindIO dumps and orders every live rank to exit; each
  writes its own dying-gasp checkpoint and exits 3 (4 if it could not).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, NoReturn, Optional, Protocol

from mindft.config import STEP_GATE_VARIABLE, MindftConfig
from mindft.exitcodes import ExitCode
from mindft.flow.follower import StepFaults
from mindft.flow.episode import retried
from mindft.mindio.gate import StepGateClient
from mindft.mindio.rank import MindioExit, MindioRank, RankCallbacks, RecoveryRequested, ResetRequested
from mindft.mindio.wheel import MindioError
from mindft.protocol import FaultKind
from mindft.rank.agent_watch import exit_now
from mindft.rank.loop import GivenUp
from mindft.snapshot.store import SnapshotError, SnapshotStore

log = logging.getLogger(__name__)

# Seconds a rank ordered to exit by MindIO may take to write its checkpoint before it is ended.
EXIT_GRACE = 60.0


class Engine(Protocol):
    """What :class:`MindioLoop` needs of its :class:`~mindft.rank.engine.RankEngine`."""

    config: MindftConfig
    step: int
    meta: Dict[str, Any]
    store: Optional[SnapshotStore]
    last_recovery: Dict[str, float]

    def job_keys(self) -> Any: ...

    def open_store(self, restarted: bool) -> SnapshotStore: ...

    def capture_start(self, meta: Dict[str, Any]) -> None: ...

    def settle(self) -> Any: ...

    def put_back(self, step: int, exact: bool = True) -> int: ...

    def dump_quietly(self, step: int, reason: str) -> Optional[Path]: ...

    def dump_and_exit(self, step: int, reason: str, written: Optional[Path] = None) -> NoReturn: ...

    def close(self) -> None: ...


class GivenUpToMindio(GivenUp):
    """A fault MindIO does not replay (the script's own error, or a step that keeps failing):
    the rank closes its processor, so MindIO ends the job with every rank's dying gasp."""

    ends_rank = True


class MindioLoop:
    """The rank's coordinator under MindIO (module docstring); :meth:`start` joins the job."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rank = engine.config.rank
        self.mindio: Optional[MindioRank] = None
        self._gate: Optional[StepGateClient] = None
        self._faults = StepFaults()
        self._dumped: Optional[Path] = None
        self._restored = False

    # ---- joining and leaving ---------------------------------------------------------------

    def start(self, restarted: bool, meta: Dict[str, Any]) -> None:
        """Open the gate and the store, snapshot step 0 (a restarted rank holds its own in the node
        agent's memory), start MindIO's processor; a restarted rank rejoins through ARF."""
        engine, config = self.engine, self.engine.config
        gate = os.environ.get(STEP_GATE_VARIABLE, "").strip()
        if gate:
            self._gate = StepGateClient(gate, config.rank, engine.job_keys())
        else:
            log.info("rank=%d no step gate (%s unset): the job's collectives must keep the ranks within "
                     "one step of each other", config.rank, STEP_GATE_VARIABLE)
        # In the node agent's memory (mindft-launch): a rank that leaves its chip for a hot reset
        # finds its snapshots again, and the agent can dump them if the chip never comes back.
        store = engine.open_store(restarted)
        if restarted:
            engine.meta = meta
            log.warning("rank=%d restarted (incarnation %d): steps %s are in the node agent's memory",
                        config.rank, config.restart_count, list(store.steps))
        else:
            engine.capture_start(meta)
        callbacks = RankCallbacks(settle=engine.settle, restore=self._restore, dump=self._dump)
        self.mindio = MindioRank(config.rank, config.world_size, config.controller_ip, config.controller_port,
                                 callbacks, action_timeout=config.timeouts.repair, exit_grace=EXIT_GRACE, arf=True)
        try:
            self.mindio.start()
        except (MindioError, RuntimeError) as error:
            log.critical("rank=%d could not start MindIO's processor (controller %s:%d): %s", config.rank,
                         config.controller_ip, config.controller_port, error)
            engine.close()
            raise SystemExit(ExitCode.FAILED) from None
        if restarted:
            self._rejoin()
        log.info("rank=%d fault tolerance on MindIO TFT (controller %s:%d)", config.rank, config.controller_ip,
                 config.controller_port)

    def _rejoin(self) -> None:
        """A restarted process: MindIO's ARF repairs this rank (its own snapshot from the agent's memory)."""
        self._restored = False
        try:
            repair_step = self.mindio.rejoin()
        except (MindioExit, MindioError) as error:
            self._leave(error)
        if repair_step is None:
            log.critical("rank=%d is a restarted process (incarnation %d) but MindIO is not repairing it "
                         "(no ARF under way): MindIO takes a rank back only through ARF, which mindft-launch "
                         "starts for a hot reset; run with MINDFT_BACKEND=mindft to restart ranks from their "
                         "peers' replicas", self.rank, self.engine.config.restart_count)
            self.engine.close()
            raise SystemExit(ExitCode.FAILED)
        if not self._restored:
            self._restore(repair_step, None)
        log.warning("rank=%d rejoined through MindIO's ARF: resumed after step %d (MindIO's repair step %d)",
                    self.rank, self.engine.step, repair_step)

    def _leave_device(self, why: BaseException) -> NoReturn:
        """The chip is about to be reset: exit with the snapshots settled in the node agent's memory.

        MindIO's processor is NOT destroyed: a processor that reports its exit makes MindIO's
        controller give up on the job. So the process ends at once (``os._exit``), as MindCluster
        ends it for ARF: unwinding with the processor's threads alive aborts the interpreter
        ("terminate called without an active exception", SIGABRT).
        """
        store = self.engine.store
        store.wait()
        log.warning("rank=%d leaves its device (%s); steps %s stay in the node agent's memory",
                    self.rank, why, list(store.steps))
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        store.close()
        exit_now(ExitCode.LEFT_DEVICE)

    def _leave(self, error: BaseException) -> NoReturn:
        """MindIO ended the job (or failed): this rank's dying gasp unless written, close, exit 3/4."""
        if isinstance(error, MindioExit) and self._dumped is None:
            reason = f"MindIO ended the job: {error.reason}"
        elif isinstance(error, MindioExit):
            reason = error.reason
        else:
            reason = f"MindIO failed: {error}"
        self.engine.dump_and_exit(-1, f"{reason} (MindIO cannot restart a lost rank without MindCluster's ARF; "
                                      f"mindft's fallback is a dying-gasp checkpoint)", written=self._dumped)

    def close(self) -> None:
        """Close MindIO's processor (bounded) and the gate (idempotent)."""
        if self.mindio is not None:
            self.mindio.close()
            self.mindio = None
        if self._gate is not None:
            self._gate.close()
            self._gate = None

    # ---- step boundaries (the Coordinator) ---------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Before step ``step + 1``: wait for the slowest rank, then tell MindIO the update begins.
        Raises :class:`RecoveryRequested` when MindIO stopped this rank (:meth:`stops`)."""
        try:
            if self._gate is not None:
                self._gate.wait(step, step, self.mindio)
            self.mindio.begin_update(step + 1)
        except ResetRequested as error:
            self._leave_device(error)
        except (MindioExit, MindioError) as error:
            self._leave(error)

    def end_step(self, step: int, capture: Callable[[int], None]) -> Optional[int]:
        """Snapshot ``step``, then tell MindIO it exists; the step a recovery restored, if any."""
        capture(step)
        try:
            self.mindio.end_update(step)
        except RecoveryRequested:
            self._recover(self.mindio.recover)
            return self.engine.step
        except (MindioExit, MindioError) as error:
            self._leave(error)
        return None

    def stops(self, error: BaseException) -> bool:
        """MindIO stopped this rank (a hook raised :class:`RecoveryRequested`): no fault of its own."""
        return isinstance(error, RecoveryRequested)

    def recover(self) -> Optional[int]:
        """Acknowledge MindIO's stop and wait through the recovery (the engine's step is restored)."""
        self._recover(self.mindio.recover)
        return None

    def fault(self, kind: FaultKind, detail: str, step: int, since: Optional[float] = None) -> Optional[int]:
        """Report a fault inside ``step`` to MindIO and wait through the recovery; :class:`GivenUpToMindio`
        for the script's own error and for a step that keeps failing."""
        if not self._faults.add(step) or not retried(kind):
            raise GivenUpToMindio(f"step {step} failed {self._faults.count - 1} times in a row" if retried(kind) else
                                  f"step {step} raised an exception from the training script, not a device fault")
        # Every kind is repaired the same way here (each rank restores its own snapshot), and MindIO
        # repairs in place only what it calls a UCE: report that, name the real kind in the log.
        log.warning("rank=%d fault %s inside step %d: %s; reporting it to MindIO as UCE", self.rank,
                    kind.name, step, detail)
        self._recover(lambda: self.mindio.report_fault(FaultKind.UCE))
        return None

    def finish(self, step: int) -> Optional[int]:
        """Wait at the gate until every rank is done: None, or the step a late recovery rolled back to."""
        if self._gate is None:
            return None
        try:
            self._gate.wait(step, -1, self.mindio, finished=True)
        except RecoveryRequested:
            self._recover(self.mindio.recover)
            return self.engine.step
        except ResetRequested as error:
            self._leave_device(error)
        except (MindioExit, MindioError) as error:
            self._leave(error)
        return None

    def report_costs(self, now: float) -> None:
        """MindIO's cadence is every step: no costs to report."""

    def _recover(self, wait: Callable[[], int]) -> None:
        started = time.perf_counter()
        self._restored = False
        try:
            repair_step = wait()
        except (MindioExit, MindioError) as error:
            self._leave(error)
        if not self._restored:
            # MindIO resumed without calling a handler here: this rank must still be at the repair step.
            self._restore(repair_step, None)
        self.engine.last_recovery = {"recovery_s": time.perf_counter() - started}
        log.warning("rank=%d resumed after step %d (MindIO's repair step %d)", self.rank, self.engine.step,
                    repair_step)

    # ---- MindIO's handlers (its processor thread; the training thread waits meanwhile) -------

    def _restore(self, step: int, source: Optional[int]) -> None:
        """Restore this rank's own newest snapshot at or below ``step`` (see the module docstring)."""
        restored = self.engine.put_back(step, exact=False)
        self._restored = True
        if restored < step:
            log.warning("rank=%d restored step %d and replays up to MindIO's repair step %d (this rank "
                        "never finished it; repair source %s not copied: mindft ranks restore their own "
                        "state)", self.rank, restored, step, source)
        else:
            log.warning("rank=%d restored step %d", self.rank, restored)

    def _dump(self, reason: str) -> None:
        path = self.engine.dump_quietly(-1, reason)
        if path is None:
            raise SnapshotError(f"rank {self.rank}: dying-gasp checkpoint not written")
        self._dumped = path
