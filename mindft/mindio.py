"""MindIO TFT as mindft's coordination backend: its controller and processors, mindft's state.

MindIO TFT (the ``mindio_ttp`` wheel, open source in Ascend/mind-cluster) decides *when* ranks
stop, which step they resume from and who repairs whom; mindft's in-memory snapshots do the
work inside its handlers. :class:`MindioController` starts MindIO's controller where MindSpore
would (rank 0 / node 0, and nowhere when MindCluster runs it: ``MINDX_TASK_ID`` set);
:class:`MindioRank` is one rank's processor with its handlers bound to plain callables.

What a UCE on one rank produces (driven on CPU with 2 and 4 processes, 127.0.0.1, wheel 7.3.0)
---------------------------------------------------------------------------------------------
Every rank, before training: ``tft_init_processor`` → ``tft_register_*_handler`` →
``tft_start_processor`` → ``tft_set_optimizer_replica`` (the data-parallel group; without a
replica the controller can only dump). Every step: ``tft_start_updating_os(step)``, the optimizer
update, ``tft_end_updating_os(step)``; the controller learns each rank's step *only* from these
calls (a rank that never reported a step cannot be repaired).

Faulty rank F, in its training thread, during step s (state of s not complete)::

    tft_report_error(RS_UCE)           returns at once
    tft_wait_next_action()             blocks for the whole recovery
      (controller: ~2 s fixed sleep, collect status, prelock at the newest complete step r
       of F's replicas, typically r = s on the healthy ranks, r = s - 1 on F)
      stop handler(args, ctx)          F: returns at once (the wheel knows F reported)
      clean handler(True, args, ctx)   is_uce_error=True; return 0 = repair from a replica
      repair handler(r, True, [F], {repair_type: RT_UCE_HIGHLEVEL, src: [H], dst: [F]}, ...)
      rollback handler(r, args, ctx)
    → RETRY (0); tft_get_repair_step() = r; training continues at step r + 1

Healthy rank H, in the processor's thread while its training thread is anywhere::

      stop handler(args, ctx)          must make the training thread call
                                       tft_report_error(RS_NORMAL): the wheel blocks the
                                       handler (up to TTP_NORMAL_ACTION_TIME_LIMIT) until it
                                       does; a training thread sitting in
                                       tft_start/end_updating_os at the lock step is held there
                                       until the wheel's tft_reset_limit_step after the handler
      training thread: tft_report_error(RS_NORMAL); tft_wait_next_action()
      clean handler(False, ...)        → 0
      repair handler(r, False, [F], {repair_type: RT_SEND, src: [H], dst: [F]}, ...)
      rollback handler(r, ...)
    → RETRY; repair step r.

So after a recovery every rank must hold the state of step r, which F never completed: F copies
it from a source rank's snapshot (mindft keeps snapshots off the device, in the node agent's
replica store), every rank rolls back in place to r. Here: ``repair`` on a target calls
``restore(r, source)``, ``rollback`` calls ``restore(r, None)`` everywhere.

A rank killed (SIGKILL) is noticed by missing heartbeats (~10 s), is a node error, and without
MindCluster's ARF MindIO cannot restart it: it goes to DUMP, ``save_ckpt`` handler(step,
[{type, ranks}], args, ctx) on one live replica in a new thread, ``rename`` handler(step, ctx),
then ``exit`` handler(ctx) on every live rank, and its controller stops. MindSpore's exit handler
calls ``os._exit(1)``; here the training thread is interrupted and :class:`MindioExit` is raised
with a dying-gasp exit code, and a rank that does not get out within ``exit_grace`` seconds is
ended with ``os._exit`` (a MindSpore CPU collective cannot be aborted).

A hot reset (the device plugin's reset file), with MindX's callbacks registered (driven on CPU, 2 ranks)
-------------------------------------------------------------------------------------------------------
With the four MindX callbacks registered before ``tft_init_controller(..., enable_arf=True)`` and
processors started with ``enable_arf=True``, MindIO's controller asks MindX at every fault
(``report_fault_ranks`` → ``stop_train`` → ``report_stop_complete`` → ``on_global_rank`` →
``report_strategies`` → ``change_strategy`` → ``report_result``); MindX may also start an episode
with ``tft_notify_controller_stop_train({rank: 1})`` (1 = process error: that rank gets no
stop/clean/prelock). Strategy ``recover`` (ARF): the controller marks the rank offline and waits
(up to 10 min) for a new process of it; the new processor's registration carries a non-zero
repair id (``tft_is_reboot_node()``), it reports ``RS_INIT_FINISH``, ``tft_wait_next_action``
returns after the group rebuild (``rebuild_group`` handler), it reports ``RS_PREREPAIR_FINISH``
and waits through ``repair`` (the new rank is a target) and ``rollback`` like every rank.
``change_strategy("dump")`` during that wait makes it dump and exit instead. A process that
leaves must NOT call ``tft_destroy_processor``: a processor that reports its exit makes the
controller stop serving the job. :class:`MindxStandIn` is the MindX side node 0's launcher plays.

Environment MindIO reads (set before the wheel is imported)
-----------------------------------------------------------
``MINDIO_FOR_MINDSPORE=true`` (else the wheel imports torch; set here), ``TTP_LOG_STDOUT=1``
(set here unless given: ``TTP_LOG_PATH`` crashed rank 0 once in spdlog), ``TTP_LOG_LEVEL``
(WARNING here unless given), ``TTP_NORMAL_ACTION_TIME_LIMIT`` (30..1800 s, how long a handler
waits for the training thread; from ``action_timeout``), ``TTP_RETRY_TIMES`` (connection
attempts), ``MINDX_TASK_ID`` (MindCluster runs the controller), ``MINDIO_WAIT_MINDX_TIME``.

Quirks and how they are handled
-------------------------------
* Importing ``mindio_ttp.framework_ttp`` imports mindspore even with MINDIO_FOR_MINDSPORE=true
  (it reads the device id in ``tft_init_processor``). The rank side accepts that (a training
  process has mindspore loaded anyway); the controller imports only
  ``mindio_ttp.controller_ttp``, which needs no framework.
* ``tft_destroy_processor()`` hangs until the controller is destroyed: it reports the exit, then
  waits for its receive thread, which sits in a blocking ``recv`` that only the controller's
  teardown ends (MindSpore has rank 0 destroy the controller first). Destroying the controller
  takes 3-7 s (its worker threads exit one by one). Both run in a daemon thread with a bounded
  wait; a stuck one is abandoned, never waited on, and the process still exits at once. The wheel's own ``atexit`` hooks
  (which would repeat the unbounded calls at interpreter exit) are unregistered.
* A process that abandoned a destroy aborts at exit ("terminate called without an active
  exception", SIGABRT) when the wheel's C++ static destructors meet the thread still blocked in
  it. After an abandoned destroy the process therefore ends with ``_exit(status)`` once Python
  has finalized, skipping those destructors and keeping the exit status the program chose.
* A processor destroyed while its controller lives can abort ("pure virtual method called",
  SIGABRT), rarely, under load: the destroy shuts its own connection, its receive thread wakes,
  still sees it connected and reconnects through the link being deleted. The controller's
  destroy first tells every processor it ends, which turns that reconnect off: the launcher
  destroys the controller once every rank finished, and the ranks' last gate opens only then.
* ``tft_init_processor`` makes SIGTERM and SIGINT do nothing. The handlers in place before it are
  put back, so the launcher can still stop a rank.
* Prelock gives up after 3 tries when ranks drift apart (a rank mid-update is given 3 ms); the
  controller then exits or dumps. Ranks of a data-parallel job stay within one step of each
  other through their collectives; :meth:`MindioRank.report_fault` / :meth:`MindioRank.recover`
  raise :class:`MindioExit` when MindIO answers EXIT, never loop.
* The controller sleeps a fixed 2 s (``TTP_SLEEP_TIME``) after noticing a fault before it acts,
  and polls status every 2 s: a recovery takes at least ~2.1 s, however small the job. Nothing
  to handle, only to know (bench/mindio.py measures it).
* ``tft_start_updating_os`` returns normally (MindSpore mode) right after a stop: the stop is
  only visible through the stop handler, so the hooks check the flag it sets and raise
  :class:`RecoveryRequested`.
* The snapshot of a step must be complete before ``tft_end_updating_os(step)`` tells MindIO the
  step exists: capture between the update and :meth:`MindioRank.end_update`; the ``clean``
  handler calls ``settle`` to finish a capture in flight.
"""
from __future__ import annotations

import atexit
import ctypes
import enum
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import zmq

from mindft.exitcodes import ExitCode
from mindft.keys import CurveKeys, secure_client, secure_server, start_authenticator

log = logging.getLogger(__name__)

MINDX_TASK_VARIABLE = "MINDX_TASK_ID"
# What MindIO's controller reports to MindCluster's MindX (clusterd) once all four are registered.
MINDX_ACTIONS = ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result")
# How long closing waits for the wheel's destroy calls (see the quirks above). A processor reports
# its exit to the controller at once, then waits for the controller to go away: nothing is gained
# by waiting long. The controller's own teardown takes 3-7 s.
PROCESSOR_CLOSE_TIMEOUT = 3.0
CONTROLLER_CLOSE_TIMEOUT = 10.0
# A rank ordered to exit that is still stuck (e.g. in a collective) after this long is ended.
DEFAULT_EXIT_GRACE = 30.0
# The wheel accepts 30..1800 s for TTP_NORMAL_ACTION_TIME_LIMIT.
_ACTION_LIMIT_RANGE = (30, 1800)
# RepairContext.type values of the wheel (RepairType enum).
_RT_SEND, _RT_UCE_HIGHLEVEL, _RT_UCE_LOWLEVEL, _RT_RECV_REPAIR, _RT_ROLLBACK = 0, 1, 2, 3, 4
_RETRY = 0  # Action.RETRY


class MindioError(RuntimeError):
    """The MindIO wheel is missing, refused a call, or was used out of order."""


class RecoveryRequested(Exception):
    """MindIO stopped this rank for a recovery: call :meth:`MindioRank.recover`."""


class LeaveDevice(Exception):
    """The device plugin resets this rank's chip: the process must exit (mindft-launch starts it again)."""


class MindioExit(SystemExit):
    """MindIO ended the job (after a dying gasp where it could); ``code`` is the process exit code."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code)
        self.reason = reason

    def __str__(self) -> str:
        return f"MindIO ended the job ({self.reason}); exit code {self.code}"


class FaultKind(enum.Enum):
    """A fault the training thread reports; the value is the wheel's ReportState name."""

    UCE = "RS_UCE"                  # on-chip memory error, the device can be repaired
    UCE_CORRUPTED = "RS_UCE_CORRUPTED"  # memory error that corrupted state: node-level
    HCCL = "RS_HCCL_FAILED"         # communication error


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


def _set_mindio_environment(action_timeout: Optional[float] = None) -> None:
    os.environ["MINDIO_FOR_MINDSPORE"] = "true"
    os.environ.setdefault("TTP_LOG_STDOUT", "1")
    os.environ.setdefault("TTP_LOG_LEVEL", "WARNING")
    if action_timeout is not None and "TTP_NORMAL_ACTION_TIME_LIMIT" not in os.environ:
        low, high = _ACTION_LIMIT_RANGE
        os.environ["TTP_NORMAL_ACTION_TIME_LIMIT"] = str(int(min(max(action_timeout, low), high)))


def _import(name: str) -> ModuleType:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise MindioError(f"MindIO TFT is not importable ({error}); install the wheel "
                          f"(pip install mindio_ttp-*.whl) or set MINDFT_BACKEND=mindft") from None


def _unregister_atexit(*functions: Callable[..., Any]) -> None:
    for function in functions:
        atexit.unregister(function)


_teardown_skipped = False


def _skip_native_teardown_at_exit() -> None:
    """Make ``exit(status)`` call ``_exit(status)`` before the wheel's C++ static destructors run.

    glibc calls ``on_exit`` handlers as ``handler(status, arg)`` in reverse order of registration,
    interleaved with the destructors the wheel registered when it was loaded (earlier), so this
    handler runs first. ``_exit`` reads only its first argument. Python has flushed its own streams
    by then; C stdio buffers are flushed here, the last moment Python code runs at exit.
    """
    global _teardown_skipped
    if _teardown_skipped:
        return
    try:
        libc = ctypes.CDLL(None)
        on_exit, quick_end, flush = libc.on_exit, libc._exit, libc.fflush
    except (OSError, AttributeError) as error:
        log.warning("cannot skip MindIO's native teardown at exit (%s): the process may abort at exit", error)
        return
    flush.argtypes = [ctypes.c_void_p]
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    if on_exit(ctypes.cast(quick_end, ctypes.c_void_p), None) != 0:
        log.warning("on_exit refused a handler: the process may abort at exit (MindIO quirk)")
        return
    atexit.register(flush, None)
    _teardown_skipped = True


def _bounded(call: Callable[[], Any], timeout: float, what: str) -> bool:
    """Run ``call`` in a daemon thread; True if it returned within ``timeout`` (else it is abandoned)."""
    errors: list = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # reported below; a wheel error must not kill the caller
            errors.append(error)

    thread = threading.Thread(target=run, name=f"mindio-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.warning("%s did not return within %.1f s; abandoned (MindIO quirk)", what, timeout)
        _skip_native_teardown_at_exit()
        return False
    if errors:
        log.warning("%s failed: %r", what, errors[0])
        return False
    return True


def controller_runs_here(rank: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process (rank or node ``rank``) starts MindIO's controller, as MindSpore decides."""
    return rank == 0 and not environ.get(MINDX_TASK_VARIABLE, "").strip()


class MindioController:
    """MindIO's controller, started in this process (rank 0 or node 0's launcher).

    Imports only ``mindio_ttp.controller_ttp``, so no framework is loaded. TLS is off: mindft
    runs MindIO on the job's private network (its own traffic stays CurveZMQ-secured).
    """

    def __init__(self, world_size: int, ip: str, port: int,
                 mindx: Optional[Mapping[str, Callable[..., Any]]] = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 1024 <= port <= 65535:
            raise ValueError(f"MindIO controller port must be in 1024..65535, got {port}")
        if mindx is not None and sorted(mindx) != sorted(MINDX_ACTIONS):
            raise ValueError(f"mindx must map exactly {', '.join(MINDX_ACTIONS)}; got {', '.join(sorted(mindx))}")
        self.world_size, self.ip, self.port = world_size, ip, port
        self._mindx = dict(mindx) if mindx is not None else None
        self._api: Optional[ModuleType] = None

    @property
    def api(self) -> ModuleType:
        """``mindio_ttp.controller_ttp`` once started (its ``tft_notify_controller_*`` calls)."""
        if self._api is None:
            raise MindioError("MindIO controller not started")
        return self._api

    def start(self) -> None:
        """Start listening on ``ip:port``; returns once the controller is up."""
        if self._api is not None:
            raise MindioError("MindIO controller already started")
        _set_mindio_environment()
        api = _import("mindio_ttp.controller_ttp")
        _unregister_atexit(api.tft_destroy_controller)
        if self._mindx is not None:
            os.environ.setdefault("MINDIO_WAIT_MINDX_TIME", MINDX_WAIT_SECONDS)
            # Registered before init, as MindSpore's own stand-in does: the controller asks at
            # start whether all four are there, and only then consults MindX on every fault.
            for action, callback in self._mindx.items():
                if api.tft_register_mindx_callback(action, callback) != 0:
                    raise MindioError(f"MindIO refused the MindX callback {action!r}")
        api.tft_init_controller(0, self.world_size, False, enable_arf=self._mindx is not None)
        try:
            api.tft_start_controller(self.ip, self.port, False, "")
        except SystemExit:  # the wheel raises SystemExit(2) when the port is taken or invalid
            raise MindioError(f"MindIO controller could not start on {self.ip}:{self.port} "
                              f"(port in use? see MindIO's log above)") from None
        self._api = api
        log.info("MindIO controller listening on %s:%d for %d ranks", self.ip, self.port, self.world_size)

    def stop(self, timeout: float = CONTROLLER_CLOSE_TIMEOUT) -> bool:
        """Destroy the controller, waiting at most ``timeout`` s; True if it finished in time."""
        api, self._api = self._api, None
        if api is None:
            return True
        return _bounded(api.tft_destroy_controller, timeout, "tft_destroy_controller")

    def __enter__(self) -> MindioController:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
        _set_mindio_environment(self._action_timeout)
        tft = _import("mindio_ttp.framework_ttp")  # imports mindspore too (wheel quirk)
        _unregister_atexit(tft.tft_destroy_processor, tft.tft_destroy_controller)
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
        """Report a local device fault and wait for the recovery; the step to resume after."""
        tft = self._api()
        log.warning("rank=%d reporting %s to MindIO", self.rank, kind.name)
        tft.tft_report_error(tft.ReportState[kind.value].value)
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
        return _bounded(tft.tft_destroy_processor, timeout, "tft_destroy_processor")

    def __enter__(self) -> MindioRank:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the step gate -------------------------------------------------------------------------------
# MindIO locks every healthy rank at the newest step any rank reported (the controller's
# SelectLockStep): ranks that drift further apart than one step make its prelock fail and the job
# dump. A data-parallel job's all-reduce keeps them together; mindft's examples train one shard
# per rank without a collective (MindSpore's CPU collectives cannot be aborted), so on mindft-launch
# the gate plays the all-reduce's part: no rank starts step k + 1 before every rank finished k.
STEP_GATE_VARIABLE = "MINDFT_STEP_GATE"
GATE_HOLD_SECONDS = 0.1  # a request waits at most this long at the gate, so its rank can check MindIO
GATE_UNREACHABLE_AFTER = 30.0  # silence after which a rank gives up on the gate
_GATE_POLL_MS = 10
_ALL_FINISHED = -1


class StepGate:
    """The gate's server (node 0's launcher): a ZeroMQ ROUTER in one thread, CurveZMQ with ``keys``.

    A request ``{"rank", "done", "finished", "need"}`` records where the rank is (a rank that
    rolled back reports a lower ``done``) and is answered ``{"open": true}`` once every rank has
    done at least ``need`` steps (``need == -1``: every rank finished), else ``{"open": false}``
    after :data:`GATE_HOLD_SECONDS`. For a hot reset the launcher holds the gate (:meth:`hold`: the
    ranks gather at the newest step any of them finished, :meth:`gathered`) and tells the ranks
    on the chip to :meth:`leave` (``{"leave": true}``). ``when_all_finished`` runs once, in its own
    thread, when every rank first reported it finished; the ranks' last wait opens after it returned.
    """

    def __init__(self, world_size: int, ip: str, keys: Optional[CurveKeys] = None, port: int = 0,
                 when_all_finished: Optional[Callable[[], Any]] = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._context = zmq.Context()
        self._authenticator = start_authenticator(self._context, keys)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.linger = 0
        secure_server(self._socket, keys)
        host = f"[{ip}]" if ":" in ip else ip
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._done: Dict[int, int] = {}
        self._finished: Dict[int, bool] = {}
        # A hot reset (the launcher's MindxStandIn) holds the ranks at one common step and tells
        # the ranks on the chip to leave. Written from another thread: guarded by _lock.
        self._lock = threading.Lock()
        self._holding = False
        self._leaving: set = set()
        self._parked: Dict[int, int] = {}  # rank -> done, while refused and not let through since
        self._when_all_finished = when_all_finished
        self._ending: Optional[threading.Thread] = None
        self._ended = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mindft-step-gate", daemon=True)
        self._thread.start()
        log.info("step gate for %d ranks on %s (%s)", world_size, self.endpoint, "curve" if keys else "insecure")

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    def hold(self) -> None:
        """Let no rank start a step beyond the newest any rank finished: the ranks gather at one step."""
        with self._lock:
            self._holding = True

    def release(self) -> None:
        """End :meth:`hold`."""
        with self._lock:
            self._holding = False

    def leave(self, ranks: Sequence[int]) -> None:
        """Answer ``ranks``' next requests ``{"leave": true}``: they must exit (their chip is reset)."""
        with self._lock:
            self._leaving.update(ranks)

    def rejoin(self, rank: int) -> None:
        """``rank`` starts again (a new process): serve it normally."""
        with self._lock:
            self._leaving.discard(rank)
            self._parked.pop(rank, None)

    @property
    def joined(self) -> bool:
        """Every rank has asked the gate at least once (it knows where each one is)."""
        with self._lock:
            return len(self._done) >= self.world_size

    def gathered(self) -> Optional[int]:
        """While holding: the step every rank waits at, once they all do (None before)."""
        with self._lock:
            parked = [self._parked.get(rank) for rank in range(self.world_size)]
        if any(done is None for done in parked) or len(set(parked)) != 1:
            return None
        return parked[0]

    def _open(self, need: int) -> bool:
        if len(self._done) < self.world_size:
            return False
        if need == _ALL_FINISHED:
            return all(self._finished.values()) and self._end()
        if self._holding and need >= max(self._done.values()):
            return False  # only the ranks behind catch up
        return min(self._done.values()) >= need

    def _end(self) -> bool:
        """Every rank finished: whether ``when_all_finished`` has returned (started on the first call)."""
        if self._when_all_finished is None:
            return True
        if self._ending is None:
            self._ending = threading.Thread(target=self._run_when_all_finished, name="mindft-gate-end",
                                            daemon=True)
            self._ending.start()
        return self._ended.is_set()

    def _run_when_all_finished(self) -> None:
        try:
            self._when_all_finished()
        except Exception:  # the ranks must still be let out
            log.exception("step gate: the action once every rank finished failed")
        finally:
            self._ended.set()

    def _answer(self, rank: int, need: int, deadline: float, now: float) -> Optional[bytes]:
        """The answer to a waiting request, or None to keep it waiting."""
        with self._lock:
            if rank in self._leaving:
                return b'{"leave": true}'
            if self._open(need):
                self._parked.pop(rank, None)
                return b'{"open": true}'
            if now >= deadline:
                self._parked[rank] = self._done[rank]
                return b'{"open": false}'
        return None

    def _serve(self) -> None:
        waiting: list = []  # (identity, rank, need, deadline)
        try:
            while not self._stop.is_set():
                if self._socket.poll(_GATE_POLL_MS):
                    identity, payload = self._socket.recv_multipart()
                    try:
                        request = json.loads(payload)
                        rank, need = int(request["rank"]), int(request["need"])
                        if not 0 <= rank < self.world_size:
                            raise ValueError(f"rank {rank} not in 0..{self.world_size - 1}")
                        with self._lock:
                            self._done[rank] = int(request["done"])
                            self._finished[rank] = bool(request["finished"])
                    except (ValueError, KeyError, TypeError) as error:
                        log.warning("step gate refused a request: %s", error)
                        self._socket.send_multipart([identity, b'{"error": true}'])
                        continue
                    waiting.append((identity, rank, need, time.monotonic() + GATE_HOLD_SECONDS))
                now = time.monotonic()
                still = []
                for identity, rank, need, deadline in waiting:
                    answer = self._answer(rank, need, deadline, now)
                    if answer is None:
                        still.append((identity, rank, need, deadline))
                    else:
                        self._socket.send_multipart([identity, answer])
                waiting = still
        finally:
            self._socket.close(0)


class StepGateClient:
    """A rank's side of the :class:`StepGate`; every wait also checks ``mindio`` for a stop or exit."""

    def __init__(self, endpoint: str, rank: int, keys: Optional[CurveKeys] = None) -> None:
        self.endpoint, self.rank, self._keys = endpoint, rank, keys
        self._context: Optional[Any] = None
        self._socket: Optional[Any] = None

    def _connect(self) -> Any:
        if self._context is None:
            self._context = zmq.Context()
        if self._socket is None:
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.linger = 0
            secure_client(self._socket, self._keys)
            self._socket.connect(self.endpoint)
        return self._socket

    def wait(self, done: int, need: int, mindio: MindioRank, finished: bool = False) -> None:
        """Report ``done`` steps and block until every rank did ``need`` (-1: every rank finished).

        Raises :class:`RecoveryRequested` / :class:`MindioExit` as soon as MindIO asks for them,
        :class:`LeaveDevice` when the launcher says this rank's chip is reset, and
        :class:`MindioError` when the gate stays silent for :data:`GATE_UNREACHABLE_AFTER` s.
        """
        payload = json.dumps({"rank": self.rank, "done": done, "need": need, "finished": finished}).encode()
        last_answer = time.monotonic()
        while True:
            mindio.check()
            socket = self._connect()
            socket.send(payload)
            if socket.poll(GATE_HOLD_SECONDS * 1000 * 5):
                answer = json.loads(socket.recv())
                last_answer = time.monotonic()
                if answer.get("error"):
                    raise MindioError(f"rank {self.rank}: the step gate at {self.endpoint} refused "
                                      f"the request")
                if answer.get("leave"):
                    raise LeaveDevice(f"rank {self.rank}: its chip is about to be reset (hot reset)")
                if answer.get("open"):
                    return
                continue
            # No answer: drop the socket (a late reply must not answer the next request).
            socket.close(0)
            self._socket = None
            if time.monotonic() - last_answer > GATE_UNREACHABLE_AFTER:
                raise MindioError(f"rank {self.rank}: the step gate at {self.endpoint} did not answer "
                                  f"for {GATE_UNREACHABLE_AFTER:g} s (is mindft-launch on node 0 alive?)")

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None


# -- MindX's part, played by node 0's launcher ------------------------------------------------
# MindIO's error-type codes in a MindX fault-rank map (controller.cpp).
MINDX_UCE_ERROR, MINDX_PROCESS_ERROR = 0, 1
# MINDIO_WAIT_MINDX_TIME: how long MindIO's controller waits for MindX. The stand-in answers at once
# (inside the callback), so the only wait that runs out is the one after a dump, where MindIO waits
# for MindX to stop the processes and, when MindX stays silent, orders them to exit itself.
MINDX_WAIT_SECONDS = "1"
GATHER_POLL = 0.02


class StandInPhase(enum.Enum):
    """Where one fault episode is, seen from MindX's side of MindIO's controller."""

    IDLE = "idle"              # training; no fault being handled
    STOPPING = "stopping"      # stop_train sent (or asked for): MindIO pauses every healthy rank
    CHOOSING = "choosing"      # stop complete, fault ranks confirmed: MindIO offers its strategies
    REPAIRING = "repairing"    # a strategy chosen (retry, recover = ARF, dump); waiting for its result
    ENDED = "ended"            # MindIO dumps or exits: the job is over


_STANDIN_TRANSITIONS = {
    StandInPhase.IDLE: {StandInPhase.STOPPING, StandInPhase.ENDED},
    StandInPhase.STOPPING: {StandInPhase.CHOOSING, StandInPhase.ENDED},
    StandInPhase.CHOOSING: {StandInPhase.REPAIRING, StandInPhase.ENDED},
    StandInPhase.REPAIRING: {StandInPhase.IDLE, StandInPhase.ENDED},
    StandInPhase.ENDED: set(),
}


class MindxStandIn:
    """MindCluster's MindX (clusterd + TaskD) as node 0's launcher plays it for MindIO's controller.

    MindIO's controller, with these four callbacks registered (:data:`MINDX_ACTIONS`), asks MindX
    at every fault: it reports the fault ranks, waits for ``stop_train``, reports the stop complete,
    waits for the confirmed fault ranks, offers strategies (``retry`` = UCE repair in place,
    ``recover`` = ARF: the faulty processes are restarted and repaired from a replica, ``dump``,
    ``exit``) and reports the result. MindSpore answers the same way when it runs ARF without
    MindCluster (``TftHandle._mindx_stub``); MindCluster's clusterd does it for a device fault it
    sees. This stand-in answers each callback at once, from the controller's thread, and feeds
    MindIO the device plugin's reset file:

    * ``unrecovered`` for rank R: the step gate holds every rank at one common step; then
      ``stop_train({R: process error})`` (MindIO pauses the healthy ranks) and R is told to leave
      (it exits, its snapshots stay in the node agent's memory; killed after ``leave_timeout``);
      the strategy is ``recover`` (MindIO's ARF), so MindIO waits for R's new process.
    * ``recovered`` for R: once R's old process is gone, the launcher starts R again; the new
      process rejoins through ARF (:meth:`MindioRank.rejoin`); MindIO repairs and rolls every
      rank back to the gathered step.
    * ``failed``/``isolate`` (or no ``recovered`` within ``repair_timeout``): the strategy becomes
      ``dump``: MindIO has a live rank save, then orders every live rank to exit; each writes its
      dying-gasp checkpoint of the gathered step, and the launcher writes R's from memory.
    * A fault a rank reports itself (UCE) is answered ``retry``; a lost process (killed, not on a
      reset chip) ``dump``: mindft-launch does not restart it on this backend.

    ``kill(rank, why)`` / ``start(rank, why)`` queue orders for the launcher; ``alive(rank)``
    says whether the rank's process still runs.
    """

    def __init__(self, gate: StepGate, kill: Callable[[int, str], None], start: Callable[[int, str], None],
                 alive: Callable[[int], bool], leave_timeout: float = 30.0, gather_timeout: float = 60.0,
                 repair_timeout: float = 180.0) -> None:
        self._gate = gate
        self._kill, self._start, self._alive = kill, start, alive
        self.leave_timeout, self.gather_timeout, self.repair_timeout = leave_timeout, gather_timeout, repair_timeout
        self._api: Optional[ModuleType] = None
        self._lock = threading.Condition()
        self.phase = StandInPhase.IDLE
        self._initiated = False
        self._off: Dict[int, str] = {}  # rank on a chip being reset -> "leaving" | "left" | "starting"
        self._failed: Optional[str] = None
        self.strategy: Optional[str] = None
        self.result: Optional[str] = None  # why the job ended (set once MindIO dumps or exits)
        self._closing = threading.Event()
        self._threads: list = []

    # -- wiring ----------------------------------------------------------------------------------
    def callbacks(self) -> Dict[str, Callable[..., Any]]:
        """The four MindX callbacks for :class:`MindioController` (``mindx=``)."""
        return {"report_fault_ranks": self._on_fault_ranks, "report_stop_complete": self._on_stop_complete,
                "report_strategies": self._on_strategies, "report_result": self._on_result}

    def bind(self, api: ModuleType) -> None:
        """The started controller's module (its ``tft_notify_controller_*`` calls)."""
        self._api = api

    @property
    def failed(self) -> Optional[str]:
        """Why the job cannot go on (a chip failed, MindIO gave up), or None."""
        with self._lock:
            return self._failed

    @property
    def off_device(self) -> tuple:
        """Ranks whose chip is being reset (their process left or is leaving)."""
        with self._lock:
            return tuple(sorted(self._off))

    def _move(self, phase: StandInPhase) -> None:
        if phase is self.phase:
            return
        if phase not in _STANDIN_TRANSITIONS[self.phase]:
            raise MindioError(f"MindX stand-in: no transition {self.phase.value} -> {phase.value}")
        log.info("MindX stand-in: %s -> %s", self.phase.value, phase.value)
        self.phase = phase
        self._lock.notify_all()

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        if self._closing.is_set():
            return
        thread = threading.Thread(target=target, args=args, name="mindft-mindx", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _sleep(self) -> bool:
        """Wait one poll; False once :meth:`close` was called."""
        return not self._closing.wait(GATHER_POLL)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the stand-in's threads (the job is over); idempotent."""
        self._closing.set()
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    # -- device events (the reset watcher's thread) ------------------------------------------------
    def on_device_event(self, event: Any) -> None:
        """One event of :class:`mindft.resetwatch.ResetWatcher` (a :mod:`mindft.flow.inputs` value)."""
        from mindft.flow import inputs

        if isinstance(event, inputs.DeviceFaulty):
            with self._lock:
                if event.rank in self._off or self.phase is StandInPhase.ENDED:
                    return
                self._off[event.rank] = "leaving"
            log.warning("device plugin: rank %d's chip is faulty (%s, policy %s): hot reset through MindIO",
                        event.rank, event.error_code, event.policy)
            self._spawn(self._reset_episode, event.rank)
        elif isinstance(event, inputs.DeviceRecovered):
            with self._lock:
                known = self._off.get(event.rank) in ("leaving", "left")
                if known:
                    self._off[event.rank] = "starting"
            if known:
                self._spawn(self._restart, event.rank)
        elif isinstance(event, inputs.DeviceFailed):
            self._fail(f"rank {event.rank}'s chip failed the hot reset ({event.reason})", event.rank)
        elif isinstance(event, inputs.StopJob):
            self._fail(event.reason, None, graceful=True)
        else:
            log.warning("reset file: %s is not acted on with MINDFT_BACKEND=mindio (mindft's own backend "
                        "rolls every rank back on it)", type(event).__name__)

    def _reset_episode(self, rank: int) -> None:
        """Gather every rank at one step, stop them through MindIO, make ``rank`` leave its chip."""
        deadline = time.monotonic() + self.gather_timeout
        while not self._gate.joined and time.monotonic() < deadline and self._sleep():
            pass  # MindIO knows no rank before it started
        self._gate.hold()
        step = None
        while step is None and time.monotonic() < deadline and not self._closing.is_set():
            step = self._gate.gathered()
            if step is None:
                self._sleep()
        if self._closing.is_set():
            return
        if step is None:
            log.error("the ranks did not gather at one step within %.0f s; stopping them where they are",
                      self.gather_timeout)
        else:
            log.warning("every rank waits after step %d; rank %d leaves its chip", step, rank)
        with self._lock:
            # One episode at a time: a fault already in MindIO's hands is finished first.
            self._lock.wait_for(lambda: self.phase in (StandInPhase.IDLE, StandInPhase.ENDED,
                                                       StandInPhase.STOPPING) or self._failed is not None
                                or self._closing.is_set(), timeout=self.repair_timeout)
            first = self.phase is StandInPhase.IDLE
            if first:
                self._move(StandInPhase.STOPPING)
                self._initiated = True
            ranks = {r: MINDX_PROCESS_ERROR for r in self._off}
        if first:
            self._notify("tft_notify_controller_stop_train", ranks)
        self._gate.leave([rank])
        self._spawn(self._enforce_leave, rank)
        self._spawn(self._enforce_repair, rank)

    def _enforce_leave(self, rank: int) -> None:
        deadline = time.monotonic() + self.leave_timeout
        while time.monotonic() < deadline and self._alive(rank) and self._sleep():
            pass
        if self._closing.is_set():
            return
        with self._lock:
            still = self._off.get(rank) == "leaving" and self._alive(rank)
            if self._off.get(rank) == "leaving":
                self._off[rank] = "left"
        if still:
            self._kill(rank, f"did not leave its chip within {self.leave_timeout:g} s (the device plugin "
                             f"resets a chip only once its processes are gone)")

    def _enforce_repair(self, rank: int) -> None:
        with self._lock:
            gone = self._lock.wait_for(lambda: rank not in self._off or self._failed is not None
                                       or self._closing.is_set(), timeout=self.repair_timeout)
        if not gone and not self._closing.is_set():
            self._fail(f"rank {rank}'s chip was not recovered within {self.repair_timeout:g} s", rank)

    def _restart(self, rank: int) -> None:
        deadline = time.monotonic() + self.leave_timeout + 10.0
        while self._alive(rank) and time.monotonic() < deadline and self._sleep():
            pass  # the plugin waits for the old process; so does the restart
        with self._lock:
            if self._failed is not None or self._closing.is_set():
                return
            self._off.pop(rank, None)
            last = not self._off
            self._lock.notify_all()
        self._gate.rejoin(rank)
        if last:
            self._gate.release()
        self._start(rank, "its chip was reset (recovered)")

    def _fail(self, reason: str, rank: Optional[int], graceful: bool = False) -> None:
        with self._lock:
            if self._failed is not None:
                return
            self._failed = reason
            phase = self.phase
            self._lock.notify_all()
        log.error("MindX stand-in: %s; every rank writes its dying-gasp checkpoint", reason)
        if phase is StandInPhase.REPAIRING and self.strategy == "recover":
            self._notify("tft_notify_controller_change_strategy", "dump")  # MindIO leaves its ARF wait
        elif phase is StandInPhase.IDLE and graceful:
            self._gate.hold()
            self._notify("tft_notify_controller_dump")  # MindIO's own "elegant dump"
        elif phase is StandInPhase.IDLE and rank is not None:
            with self._lock:
                self._off.setdefault(rank, "leaving")
            self._spawn(self._reset_episode, rank)
        # STOPPING / CHOOSING: the strategy callback sees the failure and picks dump.

    # -- MindIO's controller thread ------------------------------------------------------------------
    def _notify(self, name: str, *args: Any) -> None:
        api = self._api
        if api is None:
            log.error("MindX stand-in: %s before MindIO's controller started; ignored", name)
            return
        code = getattr(api, name)(*args)
        if code != 0:
            log.error("MindIO's controller refused %s%r (code %s)", name, args, code)

    def _on_fault_ranks(self, errors: Mapping[int, int], codes: Any = None) -> None:
        with self._lock:
            if self.phase is not StandInPhase.IDLE:
                return  # our own stop_train, or MindIO's second report of an episode under way
            self._move(StandInPhase.STOPPING)
            self._initiated = False
            ranks = {**{int(r): int(t) for r, t in dict(errors).items()},
                     **{r: MINDX_PROCESS_ERROR for r in self._off}}
        log.warning("MindIO reports fault ranks %s; stopping the job", dict(errors))
        self._notify("tft_notify_controller_stop_train", ranks)

    def _on_stop_complete(self, code: int, message: str, errors: Mapping[int, int]) -> None:
        with self._lock:
            if code != 0:
                log.error("MindIO could not stop the job (%s: %s)", code, message)
                self._move(StandInPhase.ENDED)
                self.result = f"MindIO could not stop the job: {message}"
                return
            self._move(StandInPhase.CHOOSING)
            ranks = {**{int(r): int(t) for r, t in dict(errors).items()},
                     **{r: MINDX_PROCESS_ERROR for r in self._off}}
        self._notify("tft_notify_controller_on_global_rank", ranks, 1)

    def _on_strategies(self, errors: Mapping[int, int], strategies: Sequence[str]) -> None:
        offered = list(strategies)
        with self._lock:
            on_reset_chip = any(int(r) in self._off for r in dict(errors))
            if self._failed is not None:
                choice = "dump" if "dump" in offered else "exit"
            elif on_reset_chip:
                choice = "recover" if "recover" in offered else ("dump" if "dump" in offered else "exit")
                if choice != "recover":
                    log.error("MindIO offers %s, not ARF (recover): it cannot take the reset chip's ranks "
                              "back; falling back to %s", offered, choice)
            elif "retry" in offered:
                choice = "retry"
            else:
                choice = "dump" if "dump" in offered else "exit"
            self.strategy = choice
            self._move(StandInPhase.ENDED if choice in ("dump", "exit") else StandInPhase.REPAIRING)
            if choice in ("dump", "exit"):
                self.result = self._failed or f"MindIO cannot repair ranks {sorted(dict(errors))} ({choice})"
                self._failed = self._failed or self.result
        log.warning("MindIO offers %s for fault ranks %s: %s", offered, dict(errors), choice)
        self._notify("tft_notify_controller_change_strategy", choice)

    def _on_result(self, code: int, message: str, errors: Mapping[int, int], strategy: str) -> None:
        with self._lock:
            if code == 0:
                log.warning("MindIO: %s (%s)", message, strategy)
                if self.phase is StandInPhase.REPAIRING:
                    self._move(StandInPhase.ENDED if self._failed is not None else StandInPhase.IDLE)
                return
            log.error("MindIO: %s (code %s, strategy %s); asking for a dump", message, code, strategy)
            self._failed = self._failed or f"MindIO's {strategy} failed: {message}"
            self.result = self._failed
            self.strategy = "dump"
            self._move(StandInPhase.ENDED)
        self._notify("tft_notify_controller_change_strategy", "dump")


class MindioHost:
    """What node 0's launcher runs for a job on MindIO: MindIO's controller, the step gate and MindX's part.

    ``port`` is MindIO's controller port (MS_TFT_PORT of the ranks); the gate listens on
    ``gate_port`` (0: a free one), :attr:`gate_endpoint`, given to the ranks as ``MINDFT_STEP_GATE``.
    MindIO's own TCP is neither authenticated nor encrypted; the gate uses the job's CurveZMQ key.
    With ``reset_file`` the device plugin's reset file is watched every ``poll_interval`` s and
    fed to the :class:`MindxStandIn` (``standin`` holds its ``kill``/``start``/``alive`` and
    timeouts), registered as MindIO's MindX.
    """

    def __init__(self, world_size: int, ip: str, port: int, keys: Optional[CurveKeys] = None,
                 gate_port: int = 0, reset_file: Optional[Any] = None, poll_interval: float = 1.0,
                 standin: Optional[Mapping[str, Any]] = None) -> None:
        self._controller_args = (world_size, ip, port)
        self._gate_args = (world_size, ip, keys, gate_port)
        self._standin_args = dict(standin or {})
        self._reset = (reset_file, poll_interval)
        self.gate: Optional[StepGate] = None
        self.standin: Optional[MindxStandIn] = None
        self.controller: Optional[MindioController] = None
        self.watcher: Optional[Any] = None
        self.watcher_restarts = 0

    @property
    def gate_endpoint(self) -> str:
        """Where the ranks find the step gate (after :meth:`start`)."""
        if self.gate is None:
            raise MindioError("MindioHost not started")
        return self.gate.endpoint

    def start(self) -> None:
        """Start the gate, MindIO's controller with the MindX stand-in, then the reset watcher."""
        self.gate = StepGate(*self._gate_args, when_all_finished=self._destroy_controller_first)
        try:
            mindx = None
            if self._standin_args:
                self.standin = MindxStandIn(self.gate, **self._standin_args)
                mindx = self.standin.callbacks()
            self.controller = MindioController(*self._controller_args, mindx=mindx)
            self.controller.start()
            if self.standin is not None:
                self.standin.bind(self.controller.api)
                path, interval = self._reset
                if path is not None:
                    from mindft.resetwatch import ResetWatcher

                    self.watcher = ResetWatcher(path, interval)
                    self.watcher.start(self.standin.on_device_event)
                    log.info("watching the device plugin's reset file %s every %gs (MindIO backend)", path,
                             interval)
        except Exception:
            self.stop()
            raise

    def _destroy_controller_first(self) -> None:
        """Every rank finished: destroy the controller before any rank destroys its processor.

        The controller's destroy first tells every processor it ends, which stops their reconnect;
        a processor destroyed while the controller lives can race its own reconnect and abort
        (see the quirks above). MindSpore's rank 0 destroys the controller first for the same order.
        """
        controller = self.controller
        if controller is not None:
            log.info("every rank finished: destroying MindIO's controller before the ranks' processors")
            controller.stop()

    def check(self, max_restarts: int = 10) -> Optional[str]:
        """Restart a reset watcher that died; the reason to fail the job once it died too often."""
        watcher = self.watcher
        if watcher is None or watcher.alive:
            return None
        if self.watcher_restarts >= max_restarts:
            return (f"the reset-file watcher died {self.watcher_restarts + 1} times; device faults in "
                    f"{watcher.path} can no longer be seen")
        self.watcher_restarts += 1
        log.warning("restarting the reset-file watcher (restart %d/%d)", self.watcher_restarts, max_restarts)
        watcher.start(self.standin.on_device_event)
        return None

    def stop(self) -> None:
        """Stop all of it, bounded (idempotent)."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.standin is not None:
            self.standin.close()
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
