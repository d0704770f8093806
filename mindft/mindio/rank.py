"""One rank's MindIO processor, its handlers bound to plain callables (:class:`RankCallbacks`).

See :mod:`mindft.mindio` for what a recovery looks like from a rank's side.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from mindft.exitcodes import ExitCode
from mindft.mindio.wheel import MindioError, bounded, import_wheel, set_environment, unregister_atexit
from mindft.protocol import FaultKind

log = logging.getLogger(__name__)

# How long closing waits for the wheel's destroy of the processor. A processor reports its exit to
# the controller at once, then waits for the controller to go away: nothing is gained by waiting long.
PROCESSOR_CLOSE_TIMEOUT = 3.0
# A rank ordered to exit that is still stuck (e.g. in a collective) after this long is ended.
DEFAULT_EXIT_GRACE = 30.0
# The wheel's ReportState for each fault a rank reports itself.
REPORT_STATES: Mapping[FaultKind, str] = {FaultKind.UCE: "RS_UCE", FaultKind.COMMUNICATION: "RS_HCCL_FAILED"}
# RepairContext.type values of the wheel (RepairType enum).
_RT_SEND, _RT_UCE_HIGHLEVEL, _RT_UCE_LOWLEVEL, _RT_RECV_REPAIR, _RT_ROLLBACK = 0, 1, 2, 3, 4
_RETRY = 0  # Action.RETRY


class RecoveryRequested(Exception):
    """MindIO stopped this rank for a recovery: call :meth:`MindioRank.recover`."""


class ResetRequested(Exception):
    """The device plugin resets this rank's chip: the process must leave it (exit; mindft-launch
    starts it again). The flow's order of the same meaning is :class:`mindft.flow.follower.LeaveDevice`."""


class MindioExit(SystemExit):
    """MindIO ended the job (after a dying gasp where it could); ``code`` is the process exit code."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code)
        self.reason = reason

    def __str__(self) -> str:
        return f"MindIO ended the job ({self.reason}); exit code {self.code}"


@dataclass(frozen=True)
class RankCallbacks:
    """What a session supplies; each is called from MindIO's processor thread.

    ``settle()``: finish any snapshot capture in flight so the latest snapshot is consistent and
    reset the job's communication so it can be used again after the recovery.
    ``restore(step, source)``: load the state of ``step`` into the model in place; ``source`` is
    None to roll back from this rank's own snapshots, else the rank whose state to copy (this
    rank never completed ``step``). ``dump(reason)``: write the dying-gasp checkpoint.
    ``interrupt()``: make the training thread leave what it is blocked in (a collective), if the
    framework can; optional.
    """

    settle: Callable[[], None]
    restore: Callable[[int, Optional[int]], None]
    dump: Callable[[str], None]
    interrupt: Optional[Callable[[], None]] = None


class MindioRank:
    """One rank's MindIO processor; its handlers call back into ``callbacks``.

    The training thread calls :meth:`begin_update` / :meth:`end_update` around each optimizer
    update (capturing the step's snapshot in between), :meth:`report_fault` when it detects a
    device fault and :meth:`recover` when a hook raised :class:`RecoveryRequested`. Both return
    the step training resumes *after*. :meth:`close` never hangs.
    """

    def __init__(self, rank: int, world_size: int, ip: str, port: int, callbacks: RankCallbacks,
                 replica_ranks: Optional[Sequence[int]] = None, action_timeout: float = 180.0,
                 exit_grace: float = DEFAULT_EXIT_GRACE, arf: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
        replicas = list(range(world_size)) if replica_ranks is None else [int(r) for r in replica_ranks]
        if rank not in replicas or any(not 0 <= r < world_size for r in replicas):
            raise ValueError(f"replica_ranks {replicas} must hold rank {rank} and only ranks "
                             f"0..{world_size - 1}")
        self.rank, self.world_size, self.ip, self.port = rank, world_size, ip, port
        self._callbacks = callbacks
        self._replicas = replicas
        self._action_timeout = action_timeout
        self._exit_grace = exit_grace
        self._arf = arf
        self._tft: Optional[ModuleType] = None
        self._stop = threading.Event()
        self._exit = threading.Event()
        self._exit_code = int(ExitCode.FAILED)
        self._exit_reason = "MindIO ordered every rank to exit"
        self._handler_error: Optional[BaseException] = None
        self._closed = False

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        """Init and start the processor, connect to the controller and declare the replica group."""
        if self._tft is not None:
            raise MindioError(f"rank {self.rank}: MindIO processor already started")
        set_environment(self._action_timeout)
        tft = import_wheel("mindio_ttp.framework_ttp")  # imports mindspore too (wheel quirk)
        unregister_atexit(tft.tft_destroy_processor, tft.tft_destroy_controller)
        kept = self._signal_handlers()
        try:
            tft.tft_init_processor(self.rank, self.world_size, False, False, "", enable_uce=True,
                                   enable_arf=self._arf)
        finally:
            self._put_back_signal_handlers(kept)
        tft.tft_register_stop_handler(self._on_stop, None)
        tft.tft_register_clean_handler(self._on_clean, None)
        tft.tft_register_repair_handler(self._on_repair, None)
        tft.tft_register_rollback_handler(self._on_rollback, None)
        tft.tft_register_save_ckpt_handler(self._on_save_ckpt, None)
        tft.tft_register_rename_handler(self._on_rename, None)
        tft.tft_register_exit_handler(self._on_exit, None)
        if self._arf:
            tft.tft_register_rebuild_group_handler(self._on_rebuild_group, None)
        tft.tft_start_processor(self.ip, self.port)
        tft.tft_set_optimizer_replica(self.rank, [{"type": 1, "rank_list": self._replicas,
                                                   "replica_cnt": len(self._replicas),
                                                   "replica_shift": 0}])
        self._tft = tft
        log.info("rank=%d MindIO processor connected to %s:%d (replicas %s)", self.rank, self.ip,
                 self.port, self._replicas)

    @staticmethod
    def _signal_handlers() -> Dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def _put_back_signal_handlers(kept: Mapping[int, Any]) -> None:
        for number, handler in kept.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)

    # -- training thread ---------------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        """True once MindIO stopped this rank (or ordered it to exit) and it has not recovered yet."""
        return self._stop.is_set() or self._exit.is_set()

    def check(self) -> None:
        """Raise :class:`MindioExit` or :class:`RecoveryRequested` if MindIO asked for it."""
        if self._exit.is_set():
            raise MindioExit(self._exit_code, self._exit_reason)
        if self._stop.is_set():
            raise RecoveryRequested(f"rank {self.rank} stopped by MindIO")

    def begin_update(self, step: int) -> None:
        """Before the optimizer update of ``step`` (steps count from 1)."""
        self.check()
        self._api().tft_start_updating_os(step)
        self.check()  # the call returns normally after a stop; the flag tells

    def end_update(self, step: int) -> None:
        """After the update of ``step`` *and* the capture of its snapshot: the step now exists."""
        self._api().tft_end_updating_os(step)
        self.check()

    def report_fault(self, kind: FaultKind) -> int:
        """Report a local device fault and wait for the recovery; the step to resume after.

        MindIO repairs a memory error (:attr:`FaultKind.UCE`) and a communication error
        (:attr:`FaultKind.COMMUNICATION`) reported by the rank itself; any other kind is refused.
        """
        state = REPORT_STATES.get(FaultKind(kind))
        if state is None:
            raise ValueError(f"MindIO takes reports of {', '.join(k.value for k in REPORT_STATES)}, "
                             f"not {FaultKind(kind).value}")
        tft = self._api()
        log.warning("rank=%d reporting %s to MindIO", self.rank, kind.name)
        tft.tft_report_error(tft.ReportState[state].value)
        return self._wait_for_recovery()

    def recover(self) -> int:
        """Acknowledge a stop (after :class:`RecoveryRequested`) and wait; the step to resume after."""
        if self._exit.is_set():
            raise MindioExit(self._exit_code, self._exit_reason)
        tft = self._api()
        tft.tft_report_error(tft.ReportState.RS_NORMAL.value)
        return self._wait_for_recovery()

    def rejoin(self) -> Optional[int]:
        """A restarted process (after :meth:`start`): take part in MindIO's ARF repair of this rank.

        None when MindIO's controller is not repairing this rank (it was not restarted through
        ARF: nothing to rejoin). Otherwise reports the new process ready (``RS_INIT_FINISH``),
        waits for the group rebuild, reports ``RS_PREREPAIR_FINISH`` and waits through the
        repair and rollback handlers, as MindSpore does for an ARF-restarted rank; returns the
        step to resume after.
        """
        tft = self._api()
        if not self._arf or not tft.tft_is_reboot_node():
            return None
        log.warning("rank=%d rejoins through MindIO's process-level repair (ARF)", self.rank)
        tft.tft_report_error(tft.ReportState.RS_INIT_FINISH.value)
        if tft.tft_wait_next_action() != _RETRY or self._exit.is_set():
            raise MindioExit(self._exit_code, self._exit_reason)
        tft.tft_report_error(tft.ReportState.RS_PREREPAIR_FINISH.value)
        return self._wait_for_recovery()

    def _wait_for_recovery(self) -> int:
        tft = self._api()
        action = tft.tft_wait_next_action()
        if action != _RETRY or self._exit.is_set():
            raise MindioExit(self._exit_code, self._exit_reason)
        if self._handler_error is not None:
            error, self._handler_error = self._handler_error, None
            raise MindioError(f"rank {self.rank}: a MindIO handler failed during the recovery: "
                              f"{error!r}") from error
        step = int(tft.tft_get_repair_step())
        self._stop.clear()
        log.warning("rank=%d MindIO recovery done: resuming after step %d", self.rank, step)
        return step

    def _api(self) -> ModuleType:
        if self._tft is None:
            raise MindioError(f"rank {self.rank}: MindIO processor not started (call start())")
        return self._tft

    # -- handlers (MindIO's processor thread) --------------------------------------------------
    def _interrupt(self) -> None:
        if self._callbacks.interrupt is not None:
            try:
                self._callbacks.interrupt()
            except Exception:
                log.exception("rank=%d interrupt callback failed", self.rank)

    def _on_stop(self, args: Any, ctx: Any) -> None:
        log.info("rank=%d MindIO stop", self.rank)
        self._stop.set()
        self._interrupt()

    def _on_clean(self, is_uce_error: bool, args: Any, ctx: Any) -> int:
        try:
            self._callbacks.settle()
        except Exception as error:
            log.exception("rank=%d settle failed", self.rank)
            self._handler_error = error
            return 1
        return 0

    def _on_repair(self, step: int, need_rebuild: bool, error_ranks: Sequence[int],
                   repair_info: Mapping[str, Any], args: Any, ctx: Any) -> None:
        kind = repair_info.get("repair_type")
        sources, targets = list(repair_info.get("src", [])), list(repair_info.get("dst", []))
        log.info("rank=%d MindIO repair step %d type %s src %s dst %s", self.rank, step, kind, sources, targets)
        if kind == _RT_SEND or self.rank not in targets:
            return  # sources serve their state from mindft's snapshots: nothing to push
        source = sources[targets.index(self.rank)] if len(sources) == len(targets) else sources[0]
        self._guarded(lambda: self._callbacks.restore(step, source))

    def _on_rebuild_group(self, fault_ranks: Any, args: Any, ctx: Any) -> None:
        """Rebuilding the communication group: mindft's ranks have no group of MindIO's to rebuild."""
        log.info("rank=%d MindIO rebuilds the group for %s", self.rank, fault_ranks)

    def _on_rollback(self, step: int, args: Any, ctx: Any) -> None:
        log.info("rank=%d MindIO rollback to step %d", self.rank, step)
        self._guarded(lambda: self._callbacks.restore(step, None))

    def _guarded(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as error:  # the wheel only logs handler errors; make the training thread see it
            self._handler_error = error
            raise

    def _on_save_ckpt(self, step: int, save_info: Any, args: Any, ctx: Any) -> None:
        reason = f"MindIO cannot repair the job (dump requested at step {step})"
        try:
            self._callbacks.dump(reason)
        except Exception:
            log.exception("rank=%d dying-gasp dump failed", self.rank)
            self._exit_code, self._exit_reason = int(ExitCode.DUMP_FAILED), "dying-gasp dump failed"
            raise
        self._exit_code, self._exit_reason = int(ExitCode.DUMPED), "dying-gasp checkpoint written"

    def _on_rename(self, step: int, ctx: Any) -> None:
        """mindft's dumps are already written atomically under their final names."""

    def _on_exit(self, ctx: Any) -> None:
        log.error("rank=%d MindIO ordered exit: %s", self.rank, self._exit_reason)
        self._exit.set()
        self._interrupt()
        if self._exit_grace > 0:
            timer = threading.Timer(self._exit_grace, self._force_exit)
            timer.daemon = True
            timer.start()

    def _force_exit(self) -> None:
        if not self._closed:
            log.error("rank=%d still running %.0f s after MindIO's exit order; ending the process "
                      "with exit code %d", self.rank, self._exit_grace, self._exit_code)
            logging.shutdown()
            os._exit(self._exit_code)

    # -- close ---------------------------------------------------------------------------------
    def close(self, timeout: float = PROCESSOR_CLOSE_TIMEOUT) -> bool:
        """Destroy the processor, waiting at most ``timeout`` s; True if it finished in time.

        The wheel's destroy tells the controller this rank exits, then blocks until the controller
        is destroyed: past ``timeout`` the call is abandoned in its daemon thread (harmless, the
        process may exit).
        """
        self._closed = True
        tft, self._tft = self._tft, None
        if tft is None:
            return True
        return bounded(tft.tft_destroy_processor, timeout, "tft_destroy_processor")

    def __enter__(self) -> MindioRank:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
