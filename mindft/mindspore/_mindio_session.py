"""The per-rank engine of ``MINDFT_BACKEND=mindio``: MindIO TFT decides, mindft's snapshots do the work.

:class:`MindioSession` has the front-end interface of :class:`mindft.mindspore._session.Session`
(``start``, ``begin_step``, ``end_step``, ``fault``, ``finish``, ``close``; ``step``, ``meta``,
``enabled``, ``config``, ``store``), so :class:`~mindft.mindspore.FaultTolerantLoop` and
:func:`mindft.mindspore.train` run unchanged on it. Inside, MindIO's processor
(:class:`mindft.mindio.MindioRank`) replaces mindft's :class:`~mindft.rank.processor.Processor`:

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
  (:meth:`mindft.mindio.MindioRank.rejoin`) and restore the repair step from that memory;
* a rank killed otherwise is not restarted: MindIO dumps and orders every live rank to exit; each
  writes its own dying-gasp checkpoint and exits 3 (4 if it could not).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Mapping, NoReturn, Optional

import mindspore as ms
from mindspore import nn, ops

from mindft.config import ConfigError, MindftConfig, load_config
from mindft.exitcodes import ExitCode
from mindft.rank.faults import classify, describe
from mindft.flow.episode import retried
from mindft.net.keys import job_keys
from mindft.flow.follower import StepFaults
from mindft.mindio import (STEP_GATE_VARIABLE, LeaveDevice, MindioError, MindioExit, MindioRank, RankCallbacks,
                           RecoveryRequested, StepGateClient)
from mindft.mindspore._session import TrainingState, rng_meta, set_rng
from mindft.protocol import FaultKind
from mindft.snapshot.store import SnapshotError, SnapshotStore

log = logging.getLogger(__name__)

# Seconds a rank ordered to exit by MindIO may take to write its checkpoint before it is ended.
EXIT_GRACE = 60.0


def _end_process(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(int(code))


class MindioSession:
    """One rank's part in a MindIO-coordinated job; the same front-end interface as ``Session``.

    ``overlap`` is accepted for interface parity and ignored: MindIO must only hear of a step
    whose snapshot is complete, so every capture finishes before ``tft_end_updating_os``.
    ``snapshot_every`` must be 1 (MindIO may pick any completed step as the repair step): with
    this backend MINDFT_SNAPSHOT_EVERY unset means 1, not a budget.
    """

    def __init__(self, state: TrainingState, optimizer: Optional[nn.Cell],
                 config: Optional[MindftConfig] = None, overlap: Optional[bool] = None,
                 snapshot_every: Optional[int] = None) -> None:
        self.config = config if config is not None else load_config()
        every = snapshot_every if snapshot_every is not None else (self.config.snapshot_every or 1)
        if every != 1:
            raise ConfigError(f"MINDFT_SNAPSHOT_EVERY={every}: the mindio backend snapshots every step "
                              f"(MindIO may choose any completed step to repair); use 1 or "
                              f"MINDFT_BACKEND=mindft")
        self.state = state
        self.enabled = self.config.tft.enabled
        self.step = 0
        self.meta: Dict[str, Any] = {}
        self.resumed_from: Optional[int] = None
        self.store: Optional[SnapshotStore] = None
        self.mindio: Optional[MindioRank] = None
        self.last_recovery: Dict[str, float] = {}
        self._gate: Optional[StepGateClient] = None
        self._faults = StepFaults()
        self._dumped: Optional[Path] = None
        self._restored = False
        if not self.enabled:
            log.info("rank=%d mindft off (MS_ENABLE_TFT=%r enables nothing): training runs unprotected",
                     self.config.rank, os.environ.get("MS_ENABLE_TFT", ""))

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, meta: Optional[Mapping[str, Any]] = None) -> int:
        """Snapshot step 0 and connect to MindIO's controller. Returns the step to continue after (0)."""
        if not self.enabled:
            return self.step
        config = self.config
        restarted = config.restart_count > 0
        gate = os.environ.get(STEP_GATE_VARIABLE, "").strip()
        if gate:
            try:
                keys = job_keys(config)
            except ConfigError as error:
                log.critical("rank=%d cannot join the job: %s", config.rank, error)
                raise SystemExit(ExitCode.USAGE) from None
            self._gate = StepGateClient(gate, config.rank, keys)
        else:
            log.info("rank=%d no step gate (%s unset): the job's collectives must keep the ranks within "
                     "one step of each other", config.rank, STEP_GATE_VARIABLE)
        try:
            # In the node agent's memory (mindft-launch): a rank that leaves its chip for a hot reset
            # finds its snapshots again, and the agent can dump them if the chip never comes back.
            self.store = SnapshotStore(home=config.state_dir, resume=restarted)
        except SnapshotError as error:
            log.critical("rank=%d %s", config.rank, error)
            raise SystemExit(ExitCode.USAGE) from None
        self.meta = dict(meta or {})
        if restarted:
            log.warning("rank=%d restarted (incarnation %d): steps %s are in the node agent's memory",
                        config.rank, config.restart_count, list(self.store.steps))
        else:
            self._capture(0)
        callbacks = RankCallbacks(settle=self._settle, restore=self._restore, dump=self._dump)
        self.mindio = MindioRank(config.rank, config.world_size, config.controller_ip, config.controller_port,
                                 callbacks, action_timeout=config.timeouts.repair, exit_grace=EXIT_GRACE,
                                 arf=True)
        try:
            self.mindio.start()
        except (MindioError, RuntimeError) as error:
            log.critical("rank=%d could not start MindIO's processor (controller %s:%d): %s", config.rank,
                         config.controller_ip, config.controller_port, error)
            self.close()
            raise SystemExit(ExitCode.FAILED) from None
        if restarted:
            self._rejoin()
        log.info("rank=%d fault tolerance on MindIO TFT (controller %s:%d)", config.rank, config.controller_ip,
                 config.controller_port)
        return self.step

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
                         "peers' replicas", self.config.rank, self.config.restart_count)
            self.close()
            raise SystemExit(ExitCode.FAILED)
        if not self._restored:
            self._restore(repair_step, None)
        log.warning("rank=%d rejoined through MindIO's ARF: resumed after step %d (MindIO's repair step %d)",
                    self.config.rank, self.step, repair_step)

    def _leave_device(self, why: BaseException) -> NoReturn:
        """The chip is about to be reset: exit with the snapshots settled in the node agent's memory.

        MindIO's processor is NOT destroyed: a processor that reports its exit makes MindIO's
        controller give up on the job. So the process ends at once (``os._exit``), as MindCluster
        ends it for ARF: unwinding with the processor's threads alive aborts the interpreter
        ("terminate called without an active exception", SIGABRT).
        """
        self.store.wait()
        log.warning("rank=%d leaves its device (%s); steps %s stay in the node agent's memory",
                    self.config.rank, why, list(self.store.steps))
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        self.store.close()
        _end_process(ExitCode.LEFT_DEVICE)

    def close(self) -> None:
        """Leave the job: close MindIO's processor (bounded), the gate and the snapshots (idempotent)."""
        if self.mindio is not None:
            self.mindio.close()
            self.mindio = None
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def finish(self) -> Optional[int]:
        """Wait at the gate until every rank is done: None, or the step a late recovery rolled back to."""
        if self.mindio is None:
            return None
        self.store.wait()
        if self._gate is None:
            return None
        log.info("rank=%d done at step %d; waiting for the other ranks", self.config.rank, self.step)
        try:
            self._gate.wait(self.step, -1, self.mindio, finished=True)
        except RecoveryRequested:
            self._recover(self.mindio.recover)
            return self.step
        except LeaveDevice as error:
            self._leave_device(error)
        except (MindioExit, MindioError) as error:
            self._leave(error)
        return None

    # ---- step boundaries -----------------------------------------------------------------

    def begin_step(self) -> None:
        """Before step ``self.step + 1``: wait for the slowest rank, then tell MindIO the update begins.

        Raises :class:`RecoveryRequested` when MindIO stopped this rank (the front ends hand it
        to :meth:`fault`).
        """
        if self.mindio is None:
            return
        try:
            if self._gate is not None:
                self._gate.wait(self.step, self.step, self.mindio)
            self.mindio.begin_update(self.step + 1)
        except LeaveDevice as error:
            self._leave_device(error)
        except (MindioExit, MindioError) as error:
            self._leave(error)

    def end_step(self, meta: Optional[Mapping[str, Any]] = None) -> Optional[int]:
        """After step ``self.step + 1``: snapshot it, then tell MindIO it exists; the step rolled back to, if any."""
        self.step += 1
        if self.mindio is None:
            return None
        self.meta = dict(meta or {})
        before = self.step
        self._capture(self.step)
        try:
            self.mindio.end_update(self.step)
        except RecoveryRequested:
            self._recover(self.mindio.recover)
        except (MindioExit, MindioError) as error:
            self._leave(error)
        return self.step if self.step != before else None

    def fault(self, error: BaseException) -> int:
        """An exception escaped step ``self.step + 1``: report it to MindIO, wait, return the step restored."""
        if self.mindio is None:
            raise error
        if isinstance(error, RecoveryRequested):
            self._recover(self.mindio.recover)
            return self.step
        step = self.step + 1
        again = self._faults.add(step)
        kind = classify(error)
        if not again or not retried(kind):
            log.error("rank=%d step %d %s; giving up", self.config.rank, step,
                      f"failed {self._faults.count - 1} times in a row" if retried(kind) else
                      "raised an exception from the training script, not a device fault")
            self._dump_quietly(f"step {step}: {describe(error)}")
            self.close()
            raise error
        # Every kind is repaired the same way here (each rank restores its own snapshot), and MindIO
        # repairs in place only what it calls a UCE: report that, name the real kind in the log.
        log.warning("rank=%d fault %s inside step %d: %s; reporting it to MindIO as UCE", self.config.rank,
                    kind.name, step, describe(error))
        self._recover(lambda: self.mindio.report_fault(FaultKind.UCE))
        return self.step

    def _recover(self, wait: Any) -> None:
        started = time.perf_counter()
        self._restored = False
        try:
            repair_step = wait()
        except (MindioExit, MindioError) as error:
            self._leave(error)
        if not self._restored:
            # MindIO resumed without calling a handler here: this rank must still be at the repair step.
            self._restore(repair_step, None)
        self.last_recovery = {"recovery_s": time.perf_counter() - started}
        log.warning("rank=%d resumed after step %d (MindIO's repair step %d)", self.config.rank, self.step,
                    repair_step)

    def _leave(self, error: BaseException) -> NoReturn:
        """MindIO ended the job (or failed): write this rank's dying gasp unless done, close, exit 3/4."""
        if isinstance(error, MindioExit) and self._dumped is None:
            reason = f"MindIO ended the job: {error.reason}"
        elif isinstance(error, MindioExit):
            reason = error.reason
        else:
            reason = f"MindIO failed: {error}"
        path = self._dumped or self._dump_quietly(reason)
        log.critical("rank=%d stops: %s (MindIO cannot restart a lost rank without MindCluster's ARF; "
                     "mindft's fallback is a dying-gasp checkpoint); checkpoint: %s", self.config.rank,
                     reason, path or "NOT written")
        self.close()
        raise SystemExit(ExitCode.DUMPED if path is not None else ExitCode.DUMP_FAILED)

    # ---- MindIO's handlers (its processor thread; the training thread waits meanwhile) -----

    def _settle(self) -> None:
        try:
            self.store.wait()
        except SnapshotError as error:
            log.error("rank=%d %s", self.config.rank, error)

    def _restore(self, step: int, source: Optional[int]) -> None:
        """Restore this rank's own newest snapshot at or below ``step`` (see the module docstring)."""
        self._settle()
        arrays = self.state.arrays()
        if self.state.aliased:
            snapshot = self.store.restore(step, into=arrays)
        else:
            snapshot = self.store.restore(step)
            for name, array in snapshot.arrays.items():
                ops.assign(self.state.params[name], ms.Tensor(array.copy()))
        set_rng(snapshot.meta)
        self.meta = {k: v for k, v in snapshot.meta.items() if k != "rng_state"}
        self.step = self.resumed_from = snapshot.step
        self._restored = True
        if snapshot.step < step:
            log.warning("rank=%d restored step %d and replays up to MindIO's repair step %d (this rank "
                        "never finished it; repair source %s not copied: mindft ranks restore their own "
                        "state)", self.config.rank, snapshot.step, step, source)
        else:
            log.warning("rank=%d restored step %d", self.config.rank, snapshot.step)

    def _dump(self, reason: str) -> None:
        path = self._dump_quietly(reason)
        if path is None:
            raise SnapshotError(f"rank {self.config.rank}: dying-gasp checkpoint not written")
        self._dumped = path

    # ---- snapshots -----------------------------------------------------------------------

    def _capture(self, step: int) -> None:
        self.store.capture(step, self.state.arrays(), {"step": step, **self.meta, **rng_meta()})
        self.store.wait()

    def _dump_quietly(self, reason: str) -> Optional[Path]:
        if self.store is None:
            return None
        try:
            path = self.store.dump(self.config.dump_dir, self.config.rank, self.config.world_size)
        except SnapshotError as error:
            log.error("rank=%d dying-gasp dump failed: %s", self.config.rank, error)
            return None
        log.error("rank=%d wrote its dying-gasp checkpoint %s (%s)", self.config.rank, path, reason)
        return path
