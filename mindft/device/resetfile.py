"""The Ascend device plugin's reset file: its format, how to read it safely, how the plugin writes it.

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

A hostPath mirror is rewritten with a plain truncate-then-write, so a read can be
empty or cut short; kubelet's configMap volume swaps a ``..data`` symlink atomically.
:func:`parse_reset` turns an empty, partial, oversized, too deep or otherwise malformed
read into a :class:`ResetFileError` (never a crash); :func:`read_raw` reads reset.json and
its side files from one ConfigMap version. :func:`write_reset_file` writes a state exactly
as the plugin's deployment does (both layouts). What the file *means* over time is
:mod:`mindft.device.watch`'s business.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

log = logging.getLogger(__name__)

__all__ = ["CHECK_CODE_FILE", "NO_FAULT_POLICIES", "POLICIES", "POLICY_ISOLATE", "RESTART_TYPES", "RESTART_TYPE_FILE",
           "STATUSES", "STATUS_FAILED", "STATUS_FAULT", "STATUS_RECOVERED", "STATUS_UNRECOVERED", "UCE_ERROR_CODE",
           "RawRead", "ResetFileError", "ResetRank", "ResetState", "parse_reset", "read_raw", "read_reset_file",
           "render_reset", "write_reset_file"]

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
NO_FAULT_POLICIES = ("", "empty", "ignore", "free_reset")

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
class RawRead:
    """The bytes of one read of reset.json, with its side files from the same directory."""

    data: bytes
    check_code: Optional[str]
    restart_type: Optional[str]


def read_raw(path: Path) -> RawRead:
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
    return RawRead(data, _read_side_file(directory, CHECK_CODE_FILE), restart_type)


def read_reset_file(path: Union[Path, str]) -> ResetState:
    """Read and parse ``path`` (either mount layout); ``FileNotFoundError`` or :class:`ResetFileError`."""
    read = read_raw(Path(path))
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
