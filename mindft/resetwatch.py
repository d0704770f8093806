"""Read the Ascend device plugin's reset signal and turn it into typed device events.

With graceful fault tolerance (MindCluster 5.x/6.x, device plugin ``-hotReset=1``)
the device plugin tells a job about its faulty chips through the ConfigMap
``reset-config-<job name>``, mounted into the training container as
``/user/restore/reset/config/reset.json``::

    {"RankList": [{"RankId": 3, "LogicId": 3, "Status": "unrecovered",
                   "Policy": "reset", "InitialPolicy": "restart_request",
                   "ErrorCode": [2162169857], "ErrorCodeHex": "0x80E01801"}],
     "RetryTime": 0, "GracefulExit": 0, "UpdateTime": 1764680000}

``Status`` moves ``unrecovered`` → ``recovered`` (or ``failed``). The file is
rewritten as the state changes, so a reader may find it missing, half-written
or briefly invalid: :class:`ResetWatcher` keeps the last good state, logs the
problem once and reads again at the next poll. Fields it does not know are
ignored.

Each rank is healthy (absent or ``recovered``), faulty (``unrecovered``) or
failed; an event is emitted only when a rank moves between these:
healthy → faulty gives :class:`DeviceFaulty`, faulty/failed → healthy gives
:class:`DeviceRecovered`, anything → failed gives :class:`DeviceFailed`. A rank
that was faulty and disappears from ``RankList`` counts as recovered (the
plugin drops ranks that no longer have a fault). ``GracefulExit: 1`` means the
plugin is about to kill every training process: each listed rank that is not
yet failed gets a :class:`DeviceFailed`, so the controller has the healthy ranks
write their dying-gasp checkpoint first.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

from mindft.config import DEFAULT_RESET_FILE

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_RESET_FILE", "DeviceEvent", "DeviceFailed", "DeviceFaulty", "DeviceRecovered",
           "ResetFileError", "ResetRank", "ResetState", "ResetWatcher", "fault_state",
           "parse_reset", "read_reset_file", "render_reset", "write_reset_file"]

# Status values of a RankList entry (MindCluster "reset-config-<job name>" reference).
STATUS_UNRECOVERED = "unrecovered"
STATUS_RECOVERED = "recovered"
STATUS_FAILED = "failed"
STATUSES = (STATUS_UNRECOVERED, STATUS_RECOVERED, STATUS_FAILED)

# Hot-reset policies; "empty" and "ignore" mean the plugin found nothing to act on.
POLICIES = ("empty", "ignore", "restart_request", "restart", "free_reset", "reset", "isolate")
_NO_FAULT_POLICIES = ("", "empty", "ignore")

# An uncorrectable on-chip memory error, the example code in the MindCluster guides.
UCE_ERROR_CODE = 0x80E01801


@dataclass(frozen=True)
class DeviceFaulty:
    """The device plugin reports the chip of ``rank`` faulty (``Status: unrecovered``)."""

    rank: int
    error_code: str
    policy: str


@dataclass(frozen=True)
class DeviceRecovered:
    """The chip of ``rank`` was hot-reset successfully (``Status: recovered``)."""

    rank: int


@dataclass(frozen=True)
class DeviceFailed:
    """The chip of ``rank`` could not be recovered; the job must dump and exit."""

    rank: int
    reason: str


DeviceEvent = Union[DeviceFaulty, DeviceRecovered, DeviceFailed]


class ResetFileError(ValueError):
    """The reset file's text is not a reset document (invalid or half-written JSON)."""


@dataclass(frozen=True)
class ResetRank:
    """One entry of ``RankList``."""

    rank: int
    status: str = STATUS_UNRECOVERED
    policy: str = "restart_request"
    initial_policy: str = "restart_request"
    error_codes: tuple[int, ...] = (UCE_ERROR_CODE,)
    error_code_hex: str = ""
    logic_id: Optional[int] = None

    @property
    def error_code(self) -> str:
        """The fault code as text: ``ErrorCodeHex`` if given, else the decimal codes in hex."""
        if self.error_code_hex:
            return self.error_code_hex
        return ",".join(f"0x{code:08X}" for code in self.error_codes)

    def to_json(self) -> dict[str, Any]:
        """The entry as the device plugin writes it."""
        entry: dict[str, Any] = {"RankId": self.rank}
        if self.logic_id is not None:
            entry["LogicId"] = self.logic_id
        entry.update({"Status": self.status, "Policy": self.policy,
                      "InitialPolicy": self.initial_policy, "ErrorCode": list(self.error_codes),
                      "ErrorCodeHex": self.error_code})
        return entry


@dataclass(frozen=True)
class ResetState:
    """A parsed reset file."""

    ranks: tuple[ResetRank, ...] = ()
    retry_time: int = 0
    graceful_exit: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def rank(self, rank: int) -> Optional[ResetRank]:
        """The entry for ``rank``, or None when the plugin lists no fault for it."""
        for entry in self.ranks:
            if entry.rank == rank:
                return entry
        return None


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ResetFileError(f"{what}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise ResetFileError(f"{what}: expected an integer, got {value!r}")


def _error_codes(value: Any) -> tuple[int, ...]:
    # Documented as a 64-bit integer array; accept a single number too.
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    codes = []
    for item in items:
        try:
            codes.append(_as_int(item, "ErrorCode"))
        except ResetFileError:
            log.debug("reset file: ignoring ErrorCode item %r", item)
    return tuple(codes)


def _parse_rank(entry: Any, index: int) -> Optional[ResetRank]:
    if not isinstance(entry, dict) or "RankId" not in entry:
        log.debug("reset file: RankList[%d] has no RankId; ignored: %r", index, entry)
        return None
    rank = _as_int(entry["RankId"], f"RankList[{index}].RankId")
    if rank < 0:
        raise ResetFileError(f"RankList[{index}].RankId: negative rank {rank}")
    status = str(entry.get("Status", "")).strip().lower()
    logic_id = entry.get("LogicId")
    return ResetRank(
        rank=rank,
        status=status,
        policy=str(entry.get("Policy") or ""),
        initial_policy=str(entry.get("InitialPolicy") or ""),
        error_codes=_error_codes(entry.get("ErrorCode")),
        error_code_hex=str(entry.get("ErrorCodeHex") or ""),
        logic_id=logic_id if isinstance(logic_id, int) and not isinstance(logic_id, bool) else None,
    )


def parse_reset(text: str) -> ResetState:
    """Parse the text of a reset file; :class:`ResetFileError` if it is not one.

    Unknown fields are kept in ``extra`` (top level) or ignored (per rank).
    """
    try:
        data = json.loads(text)
    except ValueError as error:
        raise ResetFileError(f"not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ResetFileError(f"expected a JSON object, got {type(data).__name__}")
    rank_list = data.get("RankList") or []
    if not isinstance(rank_list, list):
        raise ResetFileError(f"RankList: expected a list, got {type(rank_list).__name__}")
    ranks = [entry for index, item in enumerate(rank_list)
             if (entry := _parse_rank(item, index)) is not None]
    retry = data.get("RetryTime", 0)
    graceful = data.get("GracefulExit", 0)
    known = ("RankList", "RetryTime", "GracefulExit")
    return ResetState(
        ranks=tuple(sorted(ranks, key=lambda entry: entry.rank)),
        retry_time=_as_int(retry, "RetryTime") if retry not in (None, "") else 0,
        graceful_exit=str(graceful).strip().lower() in ("1", "true"),
        extra={key: value for key, value in data.items() if key not in known},
    )


def read_reset_file(path: Path) -> ResetState:
    """Read and parse ``path``; ``FileNotFoundError`` or :class:`ResetFileError` on failure."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ResetFileError(f"not UTF-8 text ({error})") from None
    return parse_reset(text)


def render_reset(state: ResetState) -> str:
    """The JSON text the device plugin would write for ``state``."""
    document: dict[str, Any] = dict(state.extra)
    document.update({"RankList": [entry.to_json() for entry in state.ranks],
                     "RetryTime": state.retry_time,
                     "GracefulExit": 1 if state.graceful_exit else 0})
    document.setdefault("UpdateTime", int(time.time()))
    return json.dumps(document, indent=2) + "\n"


def write_reset_file(path: Path, state: ResetState) -> None:
    """Write ``state`` to ``path`` atomically (temporary file + rename), as a reader expects.

    Creates the parent directory. The file is world-readable like a ConfigMap mount.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(render_reset(state))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


class _Health(enum.Enum):
    HEALTHY = "healthy"
    FAULTY = "faulty"
    FAILED = "failed"


def _health_of(entry: ResetRank) -> Optional[_Health]:
    """Map an entry to a health; None for a status we do not know (the entry is skipped)."""
    if entry.status == STATUS_RECOVERED:
        return _Health.HEALTHY
    if entry.status == STATUS_FAILED:
        return _Health.FAILED
    if entry.status == STATUS_UNRECOVERED:
        if entry.policy.strip().lower() in _NO_FAULT_POLICIES:
            return _Health.HEALTHY
        return _Health.FAULTY
    return None


def _diff_states(previous: Mapping[int, _Health],
                 state: ResetState) -> tuple[dict[int, _Health], list[DeviceEvent]]:
    """The new per-rank health and the events that lead there from ``previous``."""
    current = dict(previous)
    events: list[DeviceEvent] = []
    listed = set()
    for entry in state.ranks:
        listed.add(entry.rank)
        health = _health_of(entry)
        if health is None:
            log.warning("reset file: rank %d has unknown Status %r (known: %s); ignored",
                        entry.rank, entry.status, ", ".join(STATUSES))
            continue
        if state.graceful_exit and health is not _Health.HEALTHY:
            health = _Health.FAILED
        before = previous.get(entry.rank, _Health.HEALTHY)
        if health is before:
            continue
        current[entry.rank] = health
        if health is _Health.FAULTY:
            events.append(DeviceFaulty(entry.rank, entry.error_code, entry.policy))
        elif health is _Health.HEALTHY:
            events.append(DeviceRecovered(entry.rank))
        else:
            reason = ("the device plugin set GracefulExit=1 (it will stop every training process)"
                      if state.graceful_exit and entry.status != STATUS_FAILED
                      else "the device plugin could not recover the device")
            events.append(DeviceFailed(entry.rank, f"{reason}: error {entry.error_code or 'unknown'}, "
                                                   f"policy {entry.policy or 'unknown'}"))
    for rank, health in previous.items():
        if rank not in listed and health is _Health.FAULTY:
            # The plugin drops a rank from RankList once its fault is gone.
            current[rank] = _Health.HEALTHY
            events.append(DeviceRecovered(rank))
    return current, events


class ResetWatcher:
    """Poll the reset file and report device events, only on change.

    Use :meth:`poll` for one read, :meth:`start`/:meth:`stop` to deliver events
    to a callback from a daemon thread (e.g. ``controller.on_device_event``), or
    iterate :meth:`events`. Never raises on a bad file: a missing, half-written
    or invalid file keeps the last good state and is read again next poll.
    """

    def __init__(self, path: Union[Path, str] = DEFAULT_RESET_FILE, poll_interval: float = 1.0) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval!r}")
        self.path = Path(path)
        self.poll_interval = poll_interval
        self._health: dict[int, _Health] = {}
        self._last_text: Optional[str] = None
        self._problem: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def faulty_ranks(self) -> tuple[int, ...]:
        """Ranks whose device is faulty according to the last good read."""
        return tuple(sorted(r for r, h in self._health.items() if h is _Health.FAULTY))

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks whose device recovery failed according to the last good read."""
        return tuple(sorted(r for r, h in self._health.items() if h is _Health.FAILED))

    def _report(self, problem: str, level: int) -> None:
        # Log a problem once, not at every poll: a missing file is the normal state of a healthy job.
        if problem != self._problem:
            log.log(level, "reset file %s: %s; reading again every %.2gs", self.path, problem,
                    self.poll_interval)
            self._problem = problem

    def poll(self) -> list[DeviceEvent]:
        """Read the file once and return the events since the last good read."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            self._report("not present (no device fault reported)", logging.INFO)
            return []
        except (OSError, UnicodeDecodeError) as error:
            self._report(f"unreadable ({error})", logging.WARNING)
            return []
        if text == self._last_text:
            return []
        try:
            state = parse_reset(text)
        except ResetFileError as error:
            # Typically a read racing the plugin's rewrite; the next poll sees the whole file.
            self._report(f"ignored, {error}", logging.WARNING)
            return []
        if self._problem is not None:
            log.info("reset file %s: readable again", self.path)
            self._problem = None
        self._last_text = text
        self._health, events = _diff_states(self._health, state)
        for event in events:
            log.info("reset file %s: %s", self.path, event)
        return events

    def events(self, stop: Optional[threading.Event] = None) -> Iterator[DeviceEvent]:
        """Yield events as they appear, polling until ``stop`` (or :meth:`stop`) is set."""
        stop = stop or self._stop
        while not stop.is_set():
            yield from self.poll()
            stop.wait(self.poll_interval)

    def run(self, callback: Callable[[DeviceEvent], Any], stop: Optional[threading.Event] = None) -> None:
        """Deliver events to ``callback`` until stopped; a raising callback is logged, not fatal."""
        for event in self.events(stop):
            try:
                callback(event)
            except Exception:  # the watcher must outlive a bad consumer
                log.exception("reset watcher: handler failed for %s", event)

    def start(self, callback: Callable[[DeviceEvent], Any]) -> None:
        """Run :meth:`run` in a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("ResetWatcher already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, args=(callback,), name="mindft-resetwatch",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the thread started by :meth:`start` and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.poll_interval + 5.0)
            self._thread = None


def fault_state(ranks: Iterable[int], status: str = STATUS_UNRECOVERED, *,
                error_code: int = UCE_ERROR_CODE, policy: str = "restart_request",
                retry_time: int = 0, graceful_exit: bool = False) -> ResetState:
    """A reset document listing ``ranks`` with one status, as the plugin writes during a hot reset."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    entries = tuple(ResetRank(rank=rank, status=status, policy=policy, initial_policy=policy,
                              error_codes=(error_code,), error_code_hex=f"0x{error_code:08X}",
                              logic_id=rank)
                    for rank in sorted(set(ranks)))
    return ResetState(ranks=entries, retry_time=retry_time, graceful_exit=graceful_exit)
