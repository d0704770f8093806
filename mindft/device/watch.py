"""Turn reads of the device plugin's reset file into the flow's device inputs, only on change.

The file's format and how it is read and written are :mod:`mindft.device.resetfile`; this module
says what a sequence of good reads means, and keeps polling whatever the file holds:

* **A bad read never means "no faults".** An empty, partial, oversized, too deep or
  otherwise malformed read keeps the last good state, is logged once, and the file is
  read again (at once while its bytes are still changing, then every poll).
* **Episodes.** The list holds only the writing node's ranks and the last writer wins: a
  rank that leaves the list has NOT recovered. A rank recovers when it is written
  ``recovered``, or when its episode is closed by a cleared list (``RankList`` ``[]`` or
  ``null``: after a reschedule, or clusterd's restart-all with ``RetryTime`` + 1).

Events are the flow's inputs (:mod:`mindft.flow.inputs`): :class:`DeviceFaulty`,
:class:`DeviceRecovered`, :class:`DeviceFailed` from the plugin; clusterd's process fault
and restart-all as :class:`RollbackAll`, its ``FaultFlushing`` as :class:`HoldRepairs`;
Volcano's ``GracefulExit`` as :class:`StopJob`. Each says what the training side must do.
"""
from __future__ import annotations

import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from mindft.config import DEFAULT_RESET_FILE
from mindft.flow.watcher import WatcherSupervision
from mindft.flow.inputs import (DeviceFailed, DeviceFaulty, DeviceInput, DeviceRecovered, HoldRepairs, RollbackAll,
                                StopJob)
from mindft.device.resetfile import (NO_FAULT_POLICIES, POLICY_ISOLATE, STATUS_FAILED, STATUS_FAULT, STATUS_RECOVERED,
                              STATUS_UNRECOVERED, STATUSES, RawRead, ResetFileError, ResetRank, ResetState, parse_reset,
                              read_raw)

log = logging.getLogger(__name__)

__all__ = ["QUICK_RETRIES", "QUICK_RETRY_DELAY", "ResetWatcher"]

# A read that fails while the file's bytes keep changing is retried at once (a writer is mid-way);
# these bound how often and how long, so that a torn read costs milliseconds, not a poll interval.
QUICK_RETRIES = 4
QUICK_RETRY_DELAY = 0.005
_TRANSIENT = ("empty", "invalid JSON", "checkCode mismatch", "changing", "dangling symlink")


class _Health(enum.Enum):
    HEALTHY = "healthy"
    FAULTY = "faulty"                # plugin "unrecovered": chip to be reset
    FAILED = "failed"                # plugin "failed" or policy isolate
    PROCESS_FAULT = "process fault"  # clusterd "fault"


def _health_of(entry: ResetRank) -> Optional[_Health]:
    """The health an entry asserts; None when it asserts nothing (unknown status, no-fault policy)."""
    if entry.status == STATUS_RECOVERED:
        return _Health.HEALTHY
    if entry.status == STATUS_FAILED or (entry.status == STATUS_UNRECOVERED and entry.policy == POLICY_ISOLATE):
        return _Health.FAILED
    if entry.status == STATUS_UNRECOVERED:
        return None if entry.policy in NO_FAULT_POLICIES else _Health.FAULTY
    if entry.status == STATUS_FAULT:
        return _Health.PROCESS_FAULT
    return None


@dataclass(frozen=True)
class _Seen:
    """What the watcher concluded from the reads so far."""

    health: Mapping[int, _Health]
    retry_time: int
    fault_flushing: bool
    graceful_exit: bool


def _diff_states(previous: Optional[_Seen], state: ResetState) -> tuple[_Seen, list[DeviceInput]]:
    """The watcher's new conclusions and the events that lead there; pure, no I/O.

    ``previous`` is None for the first good read: faults, flushing and graceful exit
    present then are reported; past recoveries and restart-alls are history.
    """
    first = previous is None
    before = previous or _Seen({}, state.retry_time, False, False)
    health = dict(before.health)
    events: list[DeviceInput] = []
    for entry in state.ranks:
        now = _health_of(entry)
        if now is None:
            continue
        if now is health.get(entry.rank, _Health.HEALTHY):
            continue
        health[entry.rank] = now
        if now is _Health.HEALTHY:
            events.append(DeviceRecovered(entry.rank, "recovered"))
        elif now is _Health.FAULTY:
            events.append(DeviceFaulty(entry.rank, entry.error_code, entry.policy, entry.initial_policy,
                                       state.retry_time, entry.logic_id))
        elif now is _Health.FAILED:
            events.append(DeviceFailed(entry.rank, f"the device plugin could not recover the device: "
                                                   f"status {entry.status}, policy {entry.policy or 'unknown'}, "
                                                   f"error {entry.error_code or 'unknown'}"))
        else:
            events.append(RollbackAll.process_fault(entry.rank, state.restart_fault_process, state.retry_time))
    restart_all = (not first and state.list_cleared and state.retry_time > before.retry_time
                   and not state.fault_flushing and not state.graceful_exit)
    if state.list_cleared and not state.fault_flushing and not state.graceful_exit:
        for rank in sorted(rank for rank, value in health.items() if value is not _Health.HEALTHY):
            health[rank] = _Health.HEALTHY
            events.append(DeviceRecovered(rank, "restart_all" if restart_all else "cleared"))
    if state.fault_flushing != before.fault_flushing:
        events.append(HoldRepairs(state.fault_flushing, state.retry_time))
    if restart_all:
        events.append(RollbackAll.restart_all(state.retry_time, state.restart_type))
    if state.graceful_exit and not before.graceful_exit:
        events.append(StopJob.graceful_exit(tuple(entry.rank for entry in state.ranks), state.retry_time))
    if not first and state.retry_time < before.retry_time:
        log.info("reset file: RetryTime went back from %d to %d (ConfigMap recreated?)",
                    before.retry_time, state.retry_time)
    health = {rank: value for rank, value in health.items() if value is not _Health.HEALTHY}
    return _Seen(health, state.retry_time, state.fault_flushing, state.graceful_exit), events


class ResetWatcher:
    """Poll the reset file and report device events, only on change.

    Use :meth:`poll` for one read, :meth:`start`/:meth:`stop` to deliver events to a
    callback from a daemon thread (e.g. ``controller.on_device_event``), or iterate
    :meth:`events`. Nothing a file holds makes it raise or stop: a missing, torn,
    oversized or malformed read keeps the last good state, is logged once per kind of
    problem and is read again. :attr:`alive`, :attr:`death`, :attr:`last_error`,
    :attr:`poll_count`, :attr:`last_poll` (monotonic) and :attr:`bad_reads` (unusable reads,
    quick retries included) let a supervisor see that the thread is still working.
    """

    def __init__(self, path: Union[Path, str] = DEFAULT_RESET_FILE, poll_interval: float = 1.0) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval!r}")
        self.path = Path(path)
        self.poll_interval = poll_interval
        self._seen: Optional[_Seen] = None
        self._good: Optional[RawRead] = None
        self._bad: Optional[RawRead] = None
        self._reported: set[str] = set()
        self._unknown_statuses: set[str] = set()
        self._restart_type: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.last_error: Optional[str] = None
        self.poll_count = 0
        self.bad_reads = 0
        self.last_poll: Optional[float] = None
        self.death: Optional[str] = None

    @property
    def alive(self) -> bool:
        """True while the thread started by :meth:`start` runs (False before start and after stop)."""
        return self._thread is not None and self._thread.is_alive()

    def _ranks_in(self, health: _Health) -> tuple[int, ...]:
        seen = self._seen.health if self._seen else {}
        return tuple(sorted(rank for rank, value in seen.items() if value is health))

    @property
    def faulty_ranks(self) -> tuple[int, ...]:
        """Ranks whose chip awaits a hot reset (``unrecovered``) according to the good reads."""
        return self._ranks_in(_Health.FAULTY)

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks whose chip recovery failed according to the good reads."""
        return self._ranks_in(_Health.FAILED)

    @property
    def process_fault_ranks(self) -> tuple[int, ...]:
        """Ranks clusterd reported ``fault`` whose episode is still open."""
        return self._ranks_in(_Health.PROCESS_FAULT)

    @property
    def fault_flushing(self) -> bool:
        """clusterd is still collecting faults (do not start training)."""
        return bool(self._seen and self._seen.fault_flushing)

    @property
    def restart_type(self) -> Optional[str]:
        """``restartType`` as last read beside the file (``hotReset``/``podReschedule``; may be stale)."""
        return self._restart_type

    def _report(self, kind: str, detail: str, level: int) -> None:
        # Log each kind of problem once until the next good read, not at every poll: torn or
        # hostile files change at every read.
        self.last_error = f"{kind}: {detail}" if level >= logging.WARNING else None
        if kind not in self._reported:
            log.log(level, "reset file %s: %s; keeping the last good state, reading again every %.2gs",
                    self.path, detail, self.poll_interval)
            self._reported.add(kind)
        else:
            log.debug("reset file %s: %s", self.path, detail)

    def _warn_unknown_statuses(self, state: ResetState) -> None:
        for entry in state.ranks:
            # Each unknown value once, and at most 64 of them: a hostile file could invent many.
            if entry.status not in STATUSES and entry.status not in self._unknown_statuses \
                    and len(self._unknown_statuses) < 64:
                log.warning("reset file %s: rank %d has unknown Status %r (known: %s); such entries are ignored",
                            self.path, entry.rank, entry.status, ", ".join(STATUSES))
                self._unknown_statuses.add(entry.status)

    def _readable_again(self) -> None:
        if self._reported - {"not present"}:
            log.info("reset file %s: readable again", self.path)
        self._reported.clear()
        self.last_error = None

    def _read_state(self) -> Optional[ResetState]:
        """A good read that differs from the last one, or None (unchanged, missing or bad).

        A read that looks like a writer caught mid-way (empty, cut short, checkCode not
        matching, bytes changing) is retried at once, a few times, while its bytes change.
        """
        last: Optional[RawRead] = None
        read: Optional[RawRead] = None
        kind, detail = "unreadable", ""
        for attempt in range(QUICK_RETRIES + 1):
            if attempt:
                time.sleep(QUICK_RETRY_DELAY * attempt)
            try:
                read = read_raw(self.path)
            except FileNotFoundError:
                if not os.path.lexists(self.path):
                    self._report("not present", "no device fault reported", logging.INFO)
                    return None
                read, kind, detail = None, "dangling symlink", "kubelet is swapping ..data"
            except ResetFileError as error:
                self.bad_reads += 1
                self._report(error.kind, str(error), logging.WARNING)
                return None
            except OSError as error:
                self.bad_reads += 1
                self._report("unreadable", str(error), logging.WARNING)
                return None
            else:
                if read == self._good:
                    self._readable_again()
                    return None
                if attempt == 0 and read == self._bad:
                    return None  # the same bad bytes as before: reported already
                try:
                    state = parse_reset(read.data, check_code=read.check_code, restart_type=read.restart_type)
                except ResetFileError as error:
                    kind, detail = error.kind, str(error)
                else:
                    # A truncate-then-write racing this read could splice two versions: accept only
                    # bytes that a second read confirms.
                    try:
                        again: Optional[RawRead] = read_raw(self.path)
                    except (OSError, ResetFileError):
                        again = None
                    if again == read:
                        self._good, self._bad = read, None
                        return state
                    kind, detail = "changing", "the file changed while it was read"
            self.bad_reads += 1
            if kind not in _TRANSIENT or (read is not None and read.data and read == last):
                break  # not a writer mid-way: the same bytes twice, or a problem no writer causes
            last = read
        if kind != "changing":
            # Remember bad bytes to skip them quietly; never a good file that merely changed
            # while it was being confirmed (it must be accepted when read whole again).
            self._bad = read
        self._report(kind, detail, logging.WARNING)
        return None

    def poll(self) -> list[DeviceInput]:
        """Read the file once and return the events since the last good read; never raises."""
        events: list[DeviceInput] = []
        try:
            state = self._read_state()
            if state is not None:
                self._warn_unknown_statuses(state)
                self._seen, events = _diff_states(self._seen, state)
                self._readable_again()
                if state.restart_type != self._restart_type:
                    log.info("reset file %s: restartType %s", self.path, state.restart_type)
                    self._restart_type = state.restart_type
        except Exception as error:  # nothing in a file may stop the watcher
            if "unexpected error" not in self._reported:
                log.exception("reset file %s: read failed unexpectedly; keeping the last good state", self.path)
            self._reported.add("unexpected error")
            self.last_error = f"unexpected error: {error!r}"
            return []
        finally:
            self.poll_count += 1
            self.last_poll = time.monotonic()
        for event in events:
            log.info("reset file %s: %s", self.path, event)
        return events

    def events(self, stop: Optional[threading.Event] = None) -> Iterator[DeviceInput]:
        """Yield events as they appear, polling until ``stop`` (or :meth:`stop`) is set."""
        stop = stop or self._stop
        while not stop.is_set():
            yield from self.poll()
            stop.wait(self.poll_interval)

    def run(self, callback: Callable[[DeviceInput], Any], stop: Optional[threading.Event] = None) -> None:
        """Deliver events to ``callback`` until stopped; a raising callback is logged, not fatal."""
        for event in self.events(stop):
            try:
                callback(event)
            except Exception:  # the watcher must outlive a bad consumer
                log.exception("reset watcher: handler failed for %s", event)

    def _run_thread(self, callback: Callable[[DeviceInput], Any]) -> None:
        try:
            self.run(callback)
        except BaseException as error:  # recorded for the supervisor; the thread ends either way
            self.death = repr(error)
            log.critical("reset watcher thread died: %r; device faults are no longer seen", error)

    def start(self, callback: Callable[[DeviceInput], Any]) -> None:
        """Run :meth:`run` in a daemon thread (again, if an earlier thread died)."""
        if self.alive:
            raise RuntimeError("ResetWatcher already started")
        self._stop.clear()
        self.death = None
        self._thread = threading.Thread(target=self._run_thread, args=(callback,), name="mindft-resetwatch",
                                        daemon=True)
        self._thread.start()

    def supervise(self, supervision: WatcherSupervision, now: float,
                  callback: Callable[[DeviceInput], Any]) -> Optional[str]:
        """Start the thread of :meth:`start` again if it died, when ``supervision`` says; the
        reason to fail the job once it died too often (None: alive, or dealt with)."""
        if self._thread is None or self.alive or self._stop.is_set():
            return None
        verdict = supervision.on_dead(now)
        if isinstance(verdict, str):
            return f"{verdict} (in {self.path})"
        if verdict:
            log.warning("restarting the reset-file watcher (restart %d/%d)", supervision.restarts,
                        supervision.max_restarts)
            self.start(callback)
        return None

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the thread started by :meth:`start` and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.poll_interval + 5.0)
            self._thread = None
