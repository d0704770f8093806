"""What the job is told besides rank messages: device events, process exits and the loss of
MindSpore's scheduler, one vocabulary.

The reset-file watcher (:mod:`mindft.device.watch`) emits these values directly, the CLI's wire
event (:class:`mindft.protocol.DeviceEvent`) is decoded into them by :func:`from_wire`, the
MindIO stand-in and :class:`mindft.flow.job.Job` consume them. Each says what happened and
what the training side must do about it; fields that only describe the event for the logs
(``retry_time``, ``cause`` ...) do not take part in equality.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from mindft.protocol import DeviceEvent, DeviceStatus

__all__ = ["DEVICE_INPUTS", "DeviceFailed", "DeviceFaulty", "DeviceInput", "DeviceRecovered", "HoldRepairs",
           "ProcessExited", "RollbackAll", "SchedulerLost", "StopJob", "from_wire"]


@dataclass(frozen=True)
class DeviceFaulty:
    """The device plugin took ``rank``'s chip into a reset episode (``unrecovered``, a hot-reset ``policy``).

    The plugin resets the chip only after every process on it is gone: it waits up to
    60 s, then gives up (``failed``, the job is rescheduled). The training side must bring
    the rank (and every other rank listed with it) to a consistent state kept outside the
    process, make the rank's process exit well within 60 s, and NOT restart it before
    :class:`DeviceRecovered` for this rank. ``error_code`` is ``0x``-prefixed upper-case
    hex, comma-joined when the NPU has several codes.
    """

    rank: int
    error_code: str = ""
    policy: str = ""
    initial_policy: str = field(default="", compare=False)
    retry_time: int = field(default=0, compare=False)
    logic_id: Optional[int] = field(default=None, compare=False)


@dataclass(frozen=True)
class DeviceRecovered:
    """The fault episode of ``rank`` is over: its chip may be used again.

    ``cause`` says why: ``"recovered"`` (the plugin wrote ``recovered`` after the
    reset), ``"cleared"`` (the list was cleared, as after a reschedule) or
    ``"restart_all"`` (clusterd cleared the list and raised ``RetryTime``; a
    :meth:`RollbackAll.restart_all` follows). The training side must start the rank's
    process again and continue from the state kept at :class:`DeviceFaulty` (or the
    process fault). Never emitted because a rank merely left the list: another node may
    have overwritten it.
    """

    rank: int
    cause: str = field(default="recovered", compare=False)


@dataclass(frozen=True)
class DeviceFailed:
    """The chip of ``rank`` will not come back in this job (``failed``, or policy ``isolate``).

    The job falls back to Volcano rescheduling (the slow path). The training side must
    have the healthy ranks write their dying-gasp checkpoint, then end the job with the
    documented exit code; restarting in place would only wait for a chip that is gone.
    """

    rank: int
    reason: str = ""


@dataclass(frozen=True)
class StopJob:
    """Stop every rank with dying-gasp checkpoints (Volcano's graceful exit, an operator).

    The training side must stop every training process now, the healthy ranks writing
    their dying-gasp checkpoint first, and must not restart anything: Volcano reschedules
    the job. ``ranks`` are the ranks the reset file listed at that moment (possibly none).
    """

    reason: str
    ranks: tuple[int, ...] = ()
    retry_time: int = field(default=0, compare=False)

    @classmethod
    def graceful_exit(cls, ranks: tuple[int, ...] = (), retry_time: int = 0) -> StopJob:
        """Volcano set ``GracefulExit: 1`` in the reset file: it is about to stop the job's pods."""
        return cls("Volcano asked every training process to exit (GracefulExit)", tuple(ranks), retry_time)


@dataclass(frozen=True)
class RollbackAll:
    """Every rank must go back to a consistent step (clusterd's process fault or restart-all).

    ``rank`` is the rank the fault is charged to (-1: none in particular). The training
    side must stop the faulty processes at once and restart from the last consistent state
    kept outside them (in-memory snapshot or checkpoint), not while :class:`HoldRepairs` is
    active. ``only_faulty`` is clusterd's ``RestartFaultProcess``: only the faulty ranks'
    processes need restarting (the flow rolls every rank back either way, the cheapest rung
    that gives what a process restart would). ``retry_time`` is clusterd's ``RetryTime``;
    ``restart_type`` the ``restartType`` read beside the reset file (may be stale) or None.
    """

    reason: str
    rank: int = -1
    only_faulty: bool = False
    retry_time: int = 0
    restart_type: Optional[str] = field(default=None, compare=False)

    @classmethod
    def process_fault(cls, rank: int, only_faulty: bool, retry_time: int = 0) -> RollbackAll:
        """clusterd wrote ``Status: fault`` for ``rank`` (process-level recovery)."""
        return cls(f"clusterd reported a fault of rank {rank}", rank, only_faulty, retry_time)

    @classmethod
    def restart_all(cls, retry_time: int, restart_type: Optional[str] = None) -> RollbackAll:
        """clusterd cleared the list and raised ``RetryTime`` to ``retry_time``: every rank restarts."""
        return cls(f"clusterd restarts every process (RetryTime {retry_time})", -1, False, retry_time,
                   restart_type)


@dataclass(frozen=True)
class HoldRepairs:
    """clusterd's ``FaultFlushing``: while ``active``, faults are still being collected.

    ``active=True``: the training side must not roll back, start or restart any training
    process (ranks already stopped stay stopped). ``active=False``: the collection is over;
    it may start processes again, as the events that come with or after it say.
    """

    active: bool
    retry_time: int = field(default=0, compare=False)


@dataclass(frozen=True)
class ProcessExited:
    """The launcher saw ``rank``'s process (``pid``) exit with ``returncode``.

    The flow must decide what follows (restart, wait for a start order, fail the job).
    """

    rank: int
    returncode: int
    pid: int = 0


@dataclass(frozen=True)
class SchedulerLost:
    """MindSpore's scheduler (``pid``, on node 0) exited with ``returncode`` while the ranks trained.

    Without it no worker can join the cluster again, and a process of the cluster it formed
    cannot join another: the flow must restart every worker behind a new scheduler (node 0's
    agent starts one before the first of them), or, when ``will_restart`` is False (the agent
    used up its restarts), fail the job with dying gasps. ``cause``: the last error line of its
    log ("" when it left none, as after SIGKILL). Only node 0's agent, in the controller's
    process, reports it: it never crosses the wire.
    """

    pid: int
    returncode: int
    cause: str = field(default="", compare=False)
    will_restart: bool = True


DeviceInput = Union[DeviceFaulty, DeviceRecovered, DeviceFailed, StopJob, RollbackAll, HoldRepairs]
DEVICE_INPUTS: tuple[type, ...] = (DeviceFaulty, DeviceRecovered, DeviceFailed, StopJob, RollbackAll, HoldRepairs)


def from_wire(message: DeviceEvent) -> DeviceInput:
    """The input a device event sent over the wire (``mindft.protocol.DeviceEvent``) stands for."""
    if message.status is DeviceStatus.FAULTY:
        return DeviceFaulty(message.rank, message.error_code, message.policy)
    if message.status is DeviceStatus.RECOVERED:
        return DeviceRecovered(message.rank)
    return DeviceFailed(message.rank, message.reason)
