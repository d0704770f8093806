"""Read the Ascend device plugin's reset signal and turn it into typed device events.

The device plugin (MindCluster 5.x/6.x, ``-hotReset=1``), clusterd and Volcano
all write the ConfigMap ``reset-config-<job name>``; the training container sees
it as ``/user/restore/reset/config/reset.json`` with ``restartType`` beside it
(and ``checkCode``, the lower-case hex SHA-256 of the exact reset.json bytes,
when the ConfigMap is mounted as a volume). The text is Go ``encoding/json`` of
a struct without tags: compact, keys in struct order, the embedded fault fields
inlined into each entry::

    {"RankList":[{"RankId":3,"LogicId":3,"Status":"unrecovered","Policy":"reset",
    "InitialPolicy":"restart_request","ErrorCode":[],"ErrorCodeHex":"80E01801"}],
    "UpdateTime":1764680000,"RetryTime":1,"FaultFlushing":false,"GracefulExit":0,
    "RestartFaultProcess":false}

Two things make reading it hard, and this module handles both:

* **How it is written.** A hostPath mirror is rewritten with a plain
  truncate-then-write, so a read can be empty or cut short; kubelet's configMap
  volume swaps a ``..data`` symlink atomically. An empty, partial, oversized,
  too deep or otherwise malformed read is a *bad read*: the last good state is
  kept, the problem is logged once, the file is read again (at once while its
  bytes are still changing, then every poll). A bad read never means "no faults".
* **What it means.** The list holds only the writing node's ranks and the last
  writer wins: a rank that leaves the list has NOT recovered. A rank recovers
  when it is written ``recovered``, or when its episode is closed by a cleared
  list (``RankList`` ``[]`` or ``null``: after a reschedule, or clusterd's
  restart-all with ``RetryTime`` + 1). See :data:`DEVICE_EVENTS` for the events
  and what the training side must do on each.
"""
from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

from mindft import flow
from mindft.config import DEFAULT_RESET_FILE

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_RESET_FILE", "DEVICE_EVENTS", "DeviceEvent", "DeviceFailed", "DeviceFaulty",
           "DeviceRecovered", "FaultFlushing", "GracefulExit", "ProcessFault", "ResetFileError",
           "ResetRank", "ResetState", "ResetWatcher", "RestartAll", "fault_state", "parse_reset",
           "read_reset_file", "render_reset", "write_reset_file"]

# Status values of a RankList entry: the device plugin's three, and clusterd's "fault".
STATUS_UNRECOVERED = "unrecovered"
STATUS_RECOVERED = "recovered"
STATUS_FAILED = "failed"
STATUS_FAULT = "fault"
STATUSES = (STATUS_UNRECOVERED, STATUS_RECOVERED, STATUS_FAILED, STATUS_FAULT)

# Policies. The plugin writes restart_request/restart/reset/isolate; "empty" and "ignore" mean
# it found nothing to act on, and free_reset chips are reset later when idle, without the job.
POLICIES = ("empty", "ignore", "restart_request", "restart", "free_reset", "reset", "isolate")
POLICY_ISOLATE = "isolate"
_NO_FAULT_POLICIES = ("", "empty", "ignore", "free_reset")

RESTART_TYPES = ("hotReset", "podReschedule")

# Names of the files beside reset.json (data keys of the ConfigMap).
CHECK_CODE_FILE = "checkCode"
RESTART_TYPE_FILE = "restartType"

# An uncorrectable on-chip memory error, the example code in the MindCluster guides.
UCE_ERROR_CODE = 0x80E01801

# Bounds on what a read accepts. The writers produce a few KB of flat JSON, four levels deep;
# a ConfigMap holds at most 1 MiB. Anything beyond these is a bad read, never a crash.
MAX_FILE_BYTES = 1 << 20
MAX_SIDE_FILE_BYTES = 256
MAX_DEPTH = 16
MAX_INT_DIGITS = 20          # an int64 has at most 19 digits
MAX_FLOAT_CHARS = 40
MAX_RANK_ENTRIES = 1 << 17
MAX_RANK = (1 << 31) - 1
MAX_NAME_CHARS = 64          # Status, Policy, InitialPolicy, restartType
MAX_HEX_CHARS = 4096         # ErrorCodeHex: every code on one NPU
_INT64 = 1 << 63

# A read that fails while the file's bytes keep changing is retried at once (a writer is mid-way);
# these bound how often and how long, so that a torn read costs milliseconds, not a poll interval.
QUICK_RETRIES = 4
QUICK_RETRY_DELAY = 0.005
_TRANSIENT = ("empty", "invalid JSON", "checkCode mismatch", "changing", "dangling symlink")


@dataclass(frozen=True)
class DeviceFaulty:
    """The device plugin wrote ``unrecovered`` for ``rank`` (a fault with a hot-reset ``policy``).

    The plugin resets the chip only after every process on it is gone: it waits up to
    60 s, then gives up (``failed``, the job is rescheduled). The training side must bring
    the rank (and every other rank listed with it) to a consistent state kept outside the
    process, make the rank's process exit well within 60 s, and NOT restart it before
    :class:`DeviceRecovered` for this rank. ``error_code`` is ``0x``-prefixed upper-case
    hex, comma-joined when the NPU has several codes.
    """

    rank: int
    error_code: str
    policy: str
    initial_policy: str = field(default="", compare=False)
    retry_time: int = field(default=0, compare=False)
    logic_id: Optional[int] = field(default=None, compare=False)


@dataclass(frozen=True)
class DeviceRecovered:
    """The fault episode of ``rank`` is over: its chip may be used again.

    ``cause`` says why: ``"recovered"`` (the plugin wrote ``recovered`` after the
    reset), ``"cleared"`` (the list was cleared, as after a reschedule) or
    ``"restart_all"`` (clusterd cleared the list and raised ``RetryTime``; a
    :class:`RestartAll` follows). The training side must start the rank's process again
    and continue from the state kept at :class:`DeviceFaulty` / :class:`ProcessFault`
    (for ``"restart_all"`` every rank restarts, see :class:`RestartAll`). Never emitted
    because a rank merely left the list: another node may have overwritten it.
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
    reason: str


@dataclass(frozen=True)
class ProcessFault:
    """clusterd wrote ``Status: fault`` for ``rank`` (process-level recovery).

    The training side must stop the rank's process at once. If ``restart_only_faulty``
    (``RestartFaultProcess: true``), only the listed faulty ranks are restarted and the
    others keep their state and wait for them; otherwise every rank restarts from the
    last consistent state. Nothing may start while :class:`FaultFlushing` is active.
    The rank is healthy again on :class:`DeviceRecovered`.
    """

    rank: int
    restart_only_faulty: bool
    retry_time: int = field(default=0, compare=False)


@dataclass(frozen=True)
class RestartAll:
    """clusterd cleared the list and raised ``RetryTime`` to ``retry_time``: restart every rank.

    The training side must stop every training process of the job and start them all
    again from the last consistent state (in-memory snapshot or checkpoint), unless
    :class:`FaultFlushing` is active (then wait for it to end first). ``restart_type`` is
    the ``restartType`` read beside the file (``hotReset`` or ``podReschedule``; may be
    stale) or None.
    """

    retry_time: int
    restart_type: Optional[str] = field(default=None, compare=False)


@dataclass(frozen=True)
class FaultFlushing:
    """clusterd's ``FaultFlushing`` changed to ``active``.

    ``active=True``: faults are still being collected; the training side must not start
    or restart any training process (ranks already stopped stay stopped). ``active=False``:
    the collection is over; the training side may start processes again, as the rank
    events that come with or after it say.
    """

    active: bool
    retry_time: int = field(default=0, compare=False)


@dataclass(frozen=True)
class GracefulExit:
    """Volcano set ``GracefulExit: 1``: it is about to stop the job's pods (rescheduling).

    The training side must stop every training process now, the healthy ranks writing
    their dying-gasp checkpoint first, and must not restart anything: Volcano
    reschedules the job. ``ranks`` are the ranks listed in the file at that moment
    (possibly none).
    """

    ranks: tuple[int, ...] = ()
    retry_time: int = field(default=0, compare=False)


DeviceEvent = Union[DeviceFaulty, DeviceRecovered, DeviceFailed, ProcessFault, RestartAll, FaultFlushing,
                    GracefulExit]
DEVICE_EVENTS = (DeviceFaulty, DeviceRecovered, DeviceFailed, ProcessFault, RestartAll, FaultFlushing,
                 GracefulExit)


class ResetFileError(ValueError):
    """A read of the reset file is not a usable reset document; ``kind`` names the problem class."""

    def __init__(self, detail: str, kind: str = "invalid") -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass(frozen=True)
class ResetRank:
    """One entry of ``RankList``; ``error_codes`` come from ``ErrorCodeHex`` (else ``ErrorCode``)."""

    rank: int
    status: str = STATUS_UNRECOVERED
    policy: str = "restart_request"
    initial_policy: str = "restart_request"
    error_codes: tuple[int, ...] = (UCE_ERROR_CODE,)
    error_code_hex: str = ""
    logic_id: Optional[int] = None

    @property
    def error_code(self) -> str:
        """The fault codes as ``0x``-prefixed upper-case hex, comma-joined ('' when none)."""
        return ",".join(f"0x{code:08X}" for code in self.error_codes)

    def to_json(self) -> dict[str, Any]:
        """The entry as the device plugin writes it (``ErrorCode`` empty, codes in ``ErrorCodeHex``)."""
        return {"RankId": self.rank, "LogicId": self.logic_id if self.logic_id is not None else 0,
                "Status": self.status, "Policy": self.policy, "InitialPolicy": self.initial_policy,
                "ErrorCode": [], "ErrorCodeHex": ",".join(f"{code:X}" for code in self.error_codes)}


@dataclass(frozen=True)
class ResetState:
    """A parsed reset file.

    ``list_cleared`` is true when ``RankList`` is present and ``[]`` or ``null`` (a
    cleared list closes every open episode); a file without ``RankList`` (the
    initial ``{"status":"initializing"}``) says nothing about ranks. ``skipped``
    counts entries that were dropped as unusable.
    """

    ranks: tuple[ResetRank, ...] = ()
    retry_time: int = 0
    graceful_exit: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    update_time: Optional[int] = None
    fault_flushing: bool = False
    restart_fault_process: bool = False
    list_cleared: bool = False
    restart_type: Optional[str] = None
    skipped: int = 0

    def rank(self, rank: int) -> Optional[ResetRank]:
        """The entry for ``rank``, or None when the file lists nothing for it."""
        for entry in self.ranks:
            if entry.rank == rank:
                return entry
        return None


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ResetFileError(f"a number of {len(text)} digits (at most {MAX_INT_DIGITS})", "number too long")
    return int(text)


def _bounded_float(text: str) -> float:
    if len(text) > MAX_FLOAT_CHARS:
        raise ResetFileError(f"a number of {len(text)} characters (at most {MAX_FLOAT_CHARS})", "number too long")
    return float(text)


def _no_constant(text: str) -> Any:
    raise ResetFileError(f"{text} is not JSON as the plugin writes it", "invalid JSON")


# A string token, possibly unterminated (the optional closing quote keeps the scan linear).
_STRING_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(r'[^\[\]{}]+')
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def _nesting_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting outside strings, found without recursion."""
    brackets = _NOT_BRACKET.sub("", _STRING_TOKEN.sub("", text))
    if not brackets:
        return 0
    return max(0, max(accumulate(map(_BRACKET_STEP.__getitem__, brackets))))


def _int_field(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ResetFileError(f"{what}: expected an integer, got {value!r}", "bad field")
    if isinstance(value, str):
        text = value.strip()
        if not (0 < len(text) <= MAX_INT_DIGITS and text.lstrip("-").isdigit() and text.isascii()):
            raise ResetFileError(f"{what}: expected an integer, got {value[:40]!r}", "bad field")
        value = int(text)
    if not isinstance(value, int):
        raise ResetFileError(f"{what}: expected an integer, got {type(value).__name__}", "bad field")
    if not low <= value <= high:
        raise ResetFileError(f"{what}: {value} is outside {low}..{high}", "bad field")
    return value


def _bool_field(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ResetFileError(f"{what}: expected true or false, got {str(value)[:40]!r}", "bad field")


def _name_field(value: Any, what: str) -> str:
    """A short ASCII word (Status, Policy, ...): '' for null, lower-cased."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS or not value.isascii() \
            or not value.isprintable():
        raise ResetFileError(f"{what}: expected a short ASCII word, got {str(value)[:40]!r}", "bad field")
    return value.strip().lower()


def _hex_codes(value: Any, what: str) -> tuple[int, ...]:
    """``ErrorCodeHex``: comma-joined hex codes, ``0x`` and leading zeros optional."""
    if value is None or value == "":
        return ()
    if not isinstance(value, str) or len(value) > MAX_HEX_CHARS or not value.isascii():
        raise ResetFileError(f"{what}: expected comma-joined hex codes, got {str(value)[:40]!r}", "bad field")
    codes = []
    for item in value.split(","):
        digits = item.strip()
        if digits[:2].lower() == "0x":
            digits = digits[2:]
        if not digits:
            continue
        if len(digits) > 16 or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise ResetFileError(f"{what}: {item.strip()[:40]!r} is not a hex code", "bad field")
        codes.append(int(digits, 16))
    return tuple(codes)


def _decimal_codes(value: Any, what: str) -> tuple[int, ...]:
    """``ErrorCode``: an int64 array (``[]`` from the plugin, ``null`` from clusterd)."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    return tuple(_int_field(item, what, -_INT64, _INT64 - 1) & (_INT64 * 2 - 1) for item in items)


def _parse_rank(entry: Any, index: int) -> ResetRank:
    what = f"RankList[{index}]"
    if not isinstance(entry, dict):
        raise ResetFileError(f"{what}: expected an object, got {type(entry).__name__}", "bad entry")
    if "RankId" not in entry:
        raise ResetFileError(f"{what}: no RankId", "bad entry")
    rank = _int_field(entry["RankId"], f"{what}.RankId", -1, MAX_RANK)
    if rank < 0:
        raise ResetFileError(f"{what}.RankId is -1 (an inference layout, no training rank)", "bad entry")
    logic_id = entry.get("LogicId")
    codes = _hex_codes(entry.get("ErrorCodeHex"), f"{what}.ErrorCodeHex")
    if not codes:
        codes = _decimal_codes(entry.get("ErrorCode"), f"{what}.ErrorCode")
    hex_text = entry.get("ErrorCodeHex")
    return ResetRank(
        rank=rank,
        status=_name_field(entry.get("Status"), f"{what}.Status"),
        policy=_name_field(entry.get("Policy"), f"{what}.Policy"),
        initial_policy=_name_field(entry.get("InitialPolicy"), f"{what}.InitialPolicy"),
        error_codes=codes,
        error_code_hex=hex_text.strip() if isinstance(hex_text, str) else "",
        logic_id=None if logic_id is None else _int_field(logic_id, f"{what}.LogicId", -(1 << 31), MAX_RANK),
    )


_KNOWN_KEYS = ("RankList", "UpdateTime", "RetryTime", "FaultFlushing", "GracefulExit", "RestartFaultProcess")


def parse_reset(text: Union[str, bytes], *, check_code: Optional[str] = None,
                restart_type: Optional[str] = None) -> ResetState:
    """Parse one read of a reset file; :class:`ResetFileError` if it is not a usable document.

    ``text`` is the file's bytes (or text). ``check_code``, when given, must be the
    SHA-256 of those exact bytes (a mismatch is a torn or foreign read). A bad
    ``RankList`` entry costs that entry only (counted in ``skipped``); a malformed
    top-level field, an oversized or too deeply nested document costs the read.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if len(data) > MAX_FILE_BYTES:
        raise ResetFileError(f"{len(data)} bytes (at most {MAX_FILE_BYTES})", "too large")
    if check_code is not None:
        expected = check_code.strip().lower()
        if hashlib.sha256(data).hexdigest() != expected:
            raise ResetFileError(f"checkCode {expected[:64]!r} does not match the bytes read", "checkCode mismatch")
    if not data.strip():
        raise ResetFileError("empty (a writer truncated it and has not written yet)", "empty")
    try:
        decoded = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ResetFileError(f"not UTF-8 ({error})", "not UTF-8") from None
    depth = _nesting_depth(decoded)
    if depth > MAX_DEPTH:
        raise ResetFileError(f"nested {depth} deep (at most {MAX_DEPTH})", "too deep")
    try:
        document = json.loads(decoded, parse_int=_bounded_int, parse_float=_bounded_float,
                              parse_constant=_no_constant)
    except ResetFileError:
        raise
    except (ValueError, RecursionError) as error:
        raise ResetFileError(f"not valid JSON ({str(error)[:120]})", "invalid JSON") from None
    if not isinstance(document, dict):
        raise ResetFileError(f"expected a JSON object, got {type(document).__name__}", "not an object")

    raw_list = document.get("RankList")
    if raw_list is not None and not isinstance(raw_list, list):
        raise ResetFileError(f"RankList: expected a list, got {type(raw_list).__name__}", "bad field")
    raw_list = raw_list or []
    if len(raw_list) > MAX_RANK_ENTRIES:
        raise ResetFileError(f"RankList has {len(raw_list)} entries (at most {MAX_RANK_ENTRIES})", "too large")
    ranks: dict[int, ResetRank] = {}
    skipped: list[str] = []
    for index, item in enumerate(raw_list):
        try:
            entry = _parse_rank(item, index)
        except ResetFileError as error:
            skipped.append(str(error))
            continue
        ranks[entry.rank] = entry  # a duplicate RankId: the later entry wins, as in a Go map
    if skipped:
        log.debug("reset file: %d RankList entries ignored, first: %s", len(skipped), skipped[0])

    def optional(key: str, convert: Callable[[Any, str], Any], default: Any) -> Any:
        value = document.get(key)
        return default if value is None else convert(value, key)

    graceful = optional("GracefulExit", lambda v, w: int(v) if isinstance(v, bool)
                        else _int_field(v, w, -_INT64, _INT64 - 1), 0)
    try:
        update_time: Optional[int] = optional(
            "UpdateTime", lambda v, w: _int_field(v, w, -_INT64, _INT64 - 1), None)
    except ResetFileError:
        update_time = None  # informational only; not worth losing the read
    return ResetState(
        ranks=tuple(ranks[rank] for rank in sorted(ranks)),
        retry_time=optional("RetryTime", lambda v, w: _int_field(v, w, 0, _INT64 - 1), 0),
        graceful_exit=graceful > 0,
        extra={key: value for key, value in document.items() if key not in _KNOWN_KEYS},
        update_time=update_time,
        fault_flushing=optional("FaultFlushing", _bool_field, False),
        restart_fault_process=optional("RestartFaultProcess", _bool_field, False),
        list_cleared="RankList" in document and not raw_list,
        restart_type=restart_type,
        skipped=len(skipped),
    )


def _read_bounded(path: str, limit: int) -> bytes:
    """The bytes of a regular file, at most ``limit`` + 1 of them; never blocks on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ResetFileError(f"{path} is not a regular file", "not a file")
        chunks = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_side_file(directory: str, name: str) -> Optional[str]:
    """A small file beside reset.json (``checkCode``, ``restartType``), or None when absent or unusable."""
    try:
        data = _read_bounded(os.path.join(directory, name), MAX_SIDE_FILE_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ResetFileError) as error:
        log.debug("reset file: %s unreadable (%s)", name, error)
        return None
    if len(data) > MAX_SIDE_FILE_BYTES:
        return ""  # present but not a value: a checkCode then matches nothing
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        return ""
    return text if text.isprintable() else ""


@dataclass(frozen=True)
class _Read:
    data: bytes
    check_code: Optional[str]
    restart_type: Optional[str]


def _read_files(path: Path) -> _Read:
    """One read of reset.json and its side files from the same directory.

    ``realpath`` pins kubelet's current ``..data`` target, so reset.json and checkCode
    come from the same ConfigMap version even if the symlink is swapped meanwhile.
    """
    real = os.path.realpath(path)
    data = _read_bounded(real, MAX_FILE_BYTES)
    directory = os.path.dirname(real)
    restart_type = _read_side_file(directory, RESTART_TYPE_FILE)
    if restart_type is not None and (not restart_type or len(restart_type) > MAX_NAME_CHARS):
        restart_type = None
    return _Read(data, _read_side_file(directory, CHECK_CODE_FILE), restart_type)


def read_reset_file(path: Union[Path, str]) -> ResetState:
    """Read and parse ``path`` (either mount layout); ``FileNotFoundError`` or :class:`ResetFileError`."""
    read = _read_files(Path(path))
    return parse_reset(read.data, check_code=read.check_code, restart_type=read.restart_type)


def render_reset(state: ResetState) -> str:
    """The text the device plugin writes for ``state``: compact Go JSON, Go key order.

    Unknown keys are dropped, as Go's unmarshal/marshal round trip drops them.
    """
    document = {
        "RankList": [entry.to_json() for entry in state.ranks],
        "UpdateTime": state.update_time if state.update_time is not None else int(time.time()),
        "RetryTime": state.retry_time,
        "FaultFlushing": state.fault_flushing,
        "GracefulExit": 1 if state.graceful_exit else 0,
        "RestartFaultProcess": state.restart_fault_process,
    }
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False)


def _kubelet_data_dir(path: Path) -> Optional[Path]:
    """The ``..data`` link when ``path`` is kubelet's ``name -> ..data/name`` symlink, else None."""
    if not path.is_symlink():
        return None
    target = os.readlink(path)
    if Path(target) != Path("..data") / path.name:
        return None
    return path.parent / "..data"


def _swap_kubelet_dir(data_link: Path, files: Mapping[str, str]) -> None:
    """Publish ``files`` as kubelet does: a new hidden directory, then an atomic ``..data`` swap."""
    parent = data_link.parent
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + f"{time.monotonic_ns() % 10**9:09d}"
    new_dir = parent / stamp
    new_dir.mkdir()
    for name, text in files.items():
        (new_dir / name).write_bytes(text.encode("utf-8"))
        os.chmod(new_dir / name, 0o644)
    old_dir = parent / os.readlink(data_link) if data_link.is_symlink() else None
    temporary = parent / "..data_tmp"
    if temporary.is_symlink():
        temporary.unlink()
    os.symlink(new_dir.name, temporary)
    os.replace(temporary, data_link)
    for name in files:
        if not (parent / name).is_symlink():
            os.symlink(Path("..data") / name, parent / name)
    if old_dir is not None and old_dir.is_dir() and old_dir != new_dir:
        for child in old_dir.iterdir():
            child.unlink()
        old_dir.rmdir()


def write_reset_file(path: Union[Path, str], state: ResetState, *, restart_type: Optional[str] = None) -> None:
    """Write ``state`` to ``path`` exactly as the device plugin's deployment does.

    When ``path`` is kubelet's configMap-volume symlink (``reset.json -> ..data/reset.json``)
    the ConfigMap's new version is published the kubelet way: reset.json, checkCode
    (SHA-256 of its bytes) and restartType (``restart_type`` or the current one) in a new
    hidden directory, then ``..data`` swapped atomically. Otherwise it is the plugin's
    hostPath mirror: reset.json truncated then written in place (a reader may see it empty
    or partial, as it may in production), and ``restartType`` beside it when given.
    Creates the parent directory.
    """
    path = Path(path)
    text = render_reset(state)
    data_link = _kubelet_data_dir(path)
    if data_link is not None:
        current_type = _read_side_file(str(data_link), RESTART_TYPE_FILE)
        files = {path.name: text, CHECK_CODE_FILE: hashlib.sha256(text.encode("utf-8")).hexdigest()}
        if restart_type or current_type:
            files[RESTART_TYPE_FILE] = restart_type or current_type or ""
        _swap_kubelet_dir(data_link, files)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:  # O_TRUNC, then one write: the plugin's WriteToFile
        handle.write(text)
    os.chmod(path, 0o644)
    if restart_type is not None:
        with open(path.parent / RESTART_TYPE_FILE, "w", encoding="utf-8") as handle:
            handle.write(restart_type)


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
        return None if entry.policy in _NO_FAULT_POLICIES else _Health.FAULTY
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


def _diff_states(previous: Optional[_Seen], state: ResetState) -> tuple[_Seen, list[DeviceEvent]]:
    """The watcher's new conclusions and the events that lead there; pure, no I/O.

    ``previous`` is None for the first good read: faults, flushing and graceful exit
    present then are reported; past recoveries and restart-alls are history.
    """
    first = previous is None
    before = previous or _Seen({}, state.retry_time, False, False)
    health = dict(before.health)
    events: list[DeviceEvent] = []
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
            events.append(ProcessFault(entry.rank, state.restart_fault_process, state.retry_time))
    restart_all = (not first and state.list_cleared and state.retry_time > before.retry_time
                   and not state.fault_flushing and not state.graceful_exit)
    if state.list_cleared and not state.fault_flushing and not state.graceful_exit:
        for rank in sorted(rank for rank, value in health.items() if value is not _Health.HEALTHY):
            health[rank] = _Health.HEALTHY
            events.append(DeviceRecovered(rank, "restart_all" if restart_all else "cleared"))
    if state.fault_flushing != before.fault_flushing:
        events.append(FaultFlushing(state.fault_flushing, state.retry_time))
    if restart_all:
        events.append(RestartAll(state.retry_time, state.restart_type))
    if state.graceful_exit and not before.graceful_exit:
        events.append(GracefulExit(tuple(entry.rank for entry in state.ranks), state.retry_time))
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
        self._good: Optional[_Read] = None
        self._bad: Optional[_Read] = None
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
        last: Optional[_Read] = None
        read: Optional[_Read] = None
        kind, detail = "unreadable", ""
        for attempt in range(QUICK_RETRIES + 1):
            if attempt:
                time.sleep(QUICK_RETRY_DELAY * attempt)
            try:
                read = _read_files(self.path)
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
                        again: Optional[_Read] = _read_files(self.path)
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

    def poll(self) -> list[DeviceEvent]:
        """Read the file once and return the events since the last good read; never raises."""
        events: list[DeviceEvent] = []
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

    def _run_thread(self, callback: Callable[[DeviceEvent], Any]) -> None:
        try:
            self.run(callback)
        except BaseException as error:  # recorded for the supervisor; the thread ends either way
            self.death = repr(error)
            log.critical("reset watcher thread died: %r; device faults are no longer seen", error)

    def start(self, callback: Callable[[DeviceEvent], Any]) -> None:
        """Run :meth:`run` in a daemon thread (again, if an earlier thread died)."""
        if self.alive:
            raise RuntimeError("ResetWatcher already started")
        self._stop.clear()
        self.death = None
        self._thread = threading.Thread(target=self._run_thread, args=(callback,), name="mindft-resetwatch",
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
                retry_time: int = 0, graceful_exit: bool = False,
                initial_policy: Optional[str] = None) -> ResetState:
    """A reset document listing ``ranks`` with one status, as the plugin writes during a hot reset."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    entries = tuple(ResetRank(rank=rank, status=status, policy=policy,
                              initial_policy=policy if initial_policy is None else initial_policy,
                              error_codes=(error_code,), error_code_hex=f"{error_code:X}", logic_id=rank)
                    for rank in sorted(set(ranks)))
    return ResetState(ranks=entries, retry_time=retry_time, graceful_exit=graceful_exit,
                      list_cleared=not entries)


def flow_inputs(event: DeviceEvent) -> list[flow.DeviceInput]:
    """What a reset-file event means to the recovery flow (:mod:`mindft.flow`).

    A clusterd process fault and a restart-all become a rollback of every rank to a step
    they all hold: the cheapest rung that gives what a process restart would (the processes'
    state is restored from memory). A Volcano graceful exit stops the job with dying-gasp
    checkpoints.
    """
    if isinstance(event, DeviceFaulty):
        return [flow.DeviceFaulty(event.rank, event.error_code, event.policy)]
    if isinstance(event, DeviceRecovered):
        return [flow.DeviceRecovered(event.rank)]
    if isinstance(event, DeviceFailed):
        return [flow.DeviceFailed(event.rank, event.reason)]
    if isinstance(event, ProcessFault):
        return [flow.RollbackAll(f"clusterd reported a fault of rank {event.rank}", event.rank)]
    if isinstance(event, RestartAll):
        return [flow.RollbackAll(f"clusterd restarts every process (RetryTime {event.retry_time})")]
    if isinstance(event, FaultFlushing):
        return [flow.HoldRepairs(event.active)]
    if isinstance(event, GracefulExit):
        return [flow.StopJob("Volcano asked every training process to exit (GracefulExit)")]
    raise TypeError(f"not a reset-file event: {event!r}")
