"""Reset files built the way the Go writers build them, and the two ways they reach a container.

Independent of ``mindft.device.resetfile`` on purpose: the tests must not check the reader
against its own writer. What is mirrored here, from Ascend/mind-cluster:

* ``encoding/json`` of ``TaskResetInfo`` (ascend-device-plugin ``pkg/common/proto.go``,
  ascend-common ``api.ResetCmInfo``): no struct tags, so keys in field order
  ``RankList, UpdateTime, RetryTime, FaultFlushing, GracefulExit, RestartFaultProcess``;
  each entry ``TaskDevInfo{RankId; DevFaultInfo}`` with the embedded fields inlined:
  ``RankId, LogicId, Status, Policy, InitialPolicy, ErrorCode, ErrorCodeHex``; compact;
  ``<``, ``>``, ``&`` escaped; a nil slice is ``null``.
* The plugin's ``setNewTaskInfoWithHexString``: ``ErrorCode`` becomes ``[]`` and
  ``ErrorCodeHex`` the upper-case ``strconv.FormatInt(code, 16)`` of each code, comma-joined
  (no ``0x``, no leading zeros); an empty list is ``[]``.
* clusterd's ``setNewTaskInfo``: ``fault`` entries with only ``RankId`` and ``Status``
  set (``LogicId 0``, ``""`` policies, ``ErrorCode null``).
* The hostPath mirror (``WriteToFile``: ``O_TRUNC`` then one write) and kubelet's
  configMap volume (``AtomicWriter``: a hidden timestamped directory, ``..data`` swapped
  with a rename, ``name -> ..data/name`` links).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

UPDATE_TIME = 1764680000


def go_marshal(value: Any) -> bytes:
    """``json.Marshal`` of already Go-ordered dicts: compact, HTML characters escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text.encode("utf-8")


def plugin_entry(rank: int, status: str, policy: str, initial_policy: Optional[str] = None,
                 codes: Sequence[int] = (0x80E01801,), logic_id: Optional[int] = None) -> dict[str, Any]:
    """A RankList entry as the device plugin writes it."""
    return {"RankId": rank, "LogicId": rank % 8 if logic_id is None else logic_id, "Status": status,
            "Policy": policy, "InitialPolicy": policy if initial_policy is None else initial_policy,
            "ErrorCode": [], "ErrorCodeHex": ",".join(format(code, "X") for code in codes)}


def clusterd_entry(rank: int) -> dict[str, Any]:
    """A RankList entry as clusterd writes it for a faulty rank (process-level recovery)."""
    return {"RankId": rank, "LogicId": 0, "Status": "fault", "Policy": "", "InitialPolicy": "",
            "ErrorCode": None, "ErrorCodeHex": ""}


def document(rank_list: Optional[Iterable[Mapping[str, Any]]] = (), *, retry_time: int = 0,
             fault_flushing: bool = False, graceful_exit: int = 0, restart_fault_process: bool = False,
             update_time: int = UPDATE_TIME) -> dict[str, Any]:
    """A whole ``TaskResetInfo``; ``rank_list=None`` is a nil slice (``null``)."""
    return {"RankList": None if rank_list is None else [dict(entry) for entry in rank_list],
            "UpdateTime": update_time, "RetryTime": retry_time, "FaultFlushing": fault_flushing,
            "GracefulExit": graceful_exit, "RestartFaultProcess": restart_fault_process}


def plugin_episode(ranks: Iterable[int], status: str, policy: str = "reset", *, retry_time: int,
                   initial_policy: Optional[str] = None, codes: Sequence[int] = (0x80E01801,)) -> bytes:
    """One node's write: only its ranks, one status for all (as ``GetTaskResetInfo`` does)."""
    return go_marshal(document([plugin_entry(rank, status, policy, initial_policy, codes) for rank in ranks],
                               retry_time=retry_time))


def legacy(rank_list: Optional[Iterable[Mapping[str, Any]]]) -> bytes:
    """A v5.0.x file: only ``RankList`` (nil when empty) and ``UpdateTime``."""
    ranks = None if rank_list is None else [dict(entry) for entry in rank_list] or None
    return go_marshal({"RankList": ranks, "UpdateTime": UPDATE_TIME})


INITIAL = b'{"status":"initializing"}'


def check_code(data: bytes) -> str:
    """The ConfigMap's ``checkCode``: lower-case hex SHA-256 of the exact bytes."""
    return hashlib.sha256(data).hexdigest()


class HostPathMount:
    """The plugin's mirror ``/user/restore/reset/<ns>.reset-config-<job>``: rewritten in place."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "reset.json"

    def write(self, data: bytes, restart_type: Optional[str] = None) -> None:
        """``WriteToFile``: open with O_TRUNC, then one write; ``restartType`` after it."""
        self._write(self.path, data)
        if restart_type is not None:
            self._write(self.directory / "restartType", restart_type.encode())

    def write_in_pieces(self, data: bytes, pieces: int, pause: float) -> None:
        """Truncate, then write in ``pieces`` with pauses: what a slow writer looks like to a reader."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            step = max(1, len(data) // pieces)
            for start in range(0, len(data), step):
                time.sleep(pause)
                os.write(fd, data[start:start + step])
        finally:
            os.close(fd)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


class KubeletMount:
    """A configMap volume as kubelet's AtomicWriter lays it out."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "reset.json"
        self._versions = 0

    def publish(self, data: bytes, *, restart_type: Optional[str] = "hotReset",
                code: Optional[str] = None) -> Path:
        """Publish a ConfigMap version: reset.json, checkCode (correct unless ``code``), restartType."""
        files = {"reset.json": data, "checkCode": (code if code is not None else check_code(data)).encode()}
        if restart_type is not None:
            files["restartType"] = restart_type.encode()
        self._versions += 1
        version = self.directory / time.strftime(f"..%Y_%m_%d_%H_%M_%S.{self._versions:06d}")
        version.mkdir()
        for name, content in files.items():
            (version / name).write_bytes(content)
        data_link = self.directory / "..data"
        old = self.directory / os.readlink(data_link) if data_link.is_symlink() else None
        os.symlink(version.name, self.directory / "..data_tmp")
        os.rename(self.directory / "..data_tmp", data_link)
        for name in files:
            if not (self.directory / name).is_symlink():
                os.symlink(f"..data/{name}", self.directory / name)
        if old is not None:
            for child in old.iterdir():
                child.unlink()
            old.rmdir()
        return version
