"""Play the Ascend device plugin's part of a hot reset by writing the reset file as it does.

``mindft simulate-device-plugin`` and ``mindft inject --fault hot-reset`` run
:func:`device_script`: ``unrecovered`` for some ranks, (the chip's processes gone), a wait,
then the outcome, each written with :func:`mindft.device.resetfile.write_reset_file` in the
plugin's layout, so that a job's :class:`mindft.device.watch.ResetWatcher` reacts exactly as on
a real device fault. :func:`fault_state` builds the document the plugin writes.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from mindft.device.resetfile import (POLICY_ISOLATE, STATUS_FAILED, STATUS_UNRECOVERED, STATUSES, UCE_ERROR_CODE,
                              ResetFileError, ResetRank, ResetState, read_reset_file, write_reset_file)

log = logging.getLogger(__name__)

__all__ = ["Emit", "device_script", "fault_state", "process_alive", "write_plugin_episode"]

Emit = Callable[..., None]
"""``emit(event, **fields)``: tell the user what was written (``rank`` among the fields)."""

POLL_INTERVAL = 0.05  # how often the simulated reset looks whether the chip's processes are gone


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


def write_plugin_episode(path: Path, ranks: Sequence[int], status: str, error_code: int, policy: str) -> None:
    """Write the reset file as the device plugin does for ``ranks`` of one node.

    The list holds only this node's ranks (it replaces whatever another node wrote); an
    ``unrecovered`` write opens a new episode (``RetryTime`` + 1), the outcome keeps it.
    A failed reset is written with policy ``isolate``, as the plugin does.
    """
    try:
        retry_time = read_reset_file(path).retry_time
    except (OSError, ResetFileError):
        retry_time = 0
    if status == STATUS_UNRECOVERED:
        retry_time += 1
    written_policy = POLICY_ISOLATE if status == STATUS_FAILED else policy
    state = fault_state(ranks, status, error_code=error_code, policy=written_policy, retry_time=retry_time,
                        initial_policy=policy)
    write_reset_file(path, state, restart_type="hotReset")
    log.info("reset file %s: wrote ranks %s %s, policy %s, RetryTime %d", path, ", ".join(map(str, ranks)), status,
             written_policy, retry_time)


def device_script(reset_file: Path, ranks: Sequence[int], delay: float, hold: float, outcome: Optional[str],
                  error_code: int, policy: str, emit: Emit, pids: Optional[Mapping[int, int]] = None,
                  process_deadline: float = 60.0) -> None:
    """faulty → (the chip's processes gone) → wait ``hold`` → ``outcome`` for every rank, written as
    the device plugin writes it. With ``pids`` (rank → pid on the chip) the reset waits, as the
    plugin's does, until those processes exited, and fails the chip (``failed``, ``isolate``) if
    they are still there after ``process_deadline`` seconds. ``outcome`` None leaves the chip
    ``unrecovered``. Raises OSError when the file cannot be written."""
    if delay > 0:
        time.sleep(delay)
    write_plugin_episode(reset_file, ranks, STATUS_UNRECOVERED, error_code, policy)
    for rank in ranks:
        emit("unrecovered", rank=rank, error=f"0x{error_code:08X}", policy=policy, file=str(reset_file))
    if outcome is None:
        return
    on_chip = {rank: pid for rank, pid in (pids or {}).items() if rank in ranks}
    deadline = time.monotonic() + process_deadline
    while any(process_alive(pid) for pid in on_chip.values()):
        if time.monotonic() > deadline:
            write_plugin_episode(reset_file, ranks, STATUS_FAILED, error_code, POLICY_ISOLATE)
            for rank, pid in sorted(on_chip.items()):
                emit(STATUS_FAILED, rank=rank, policy=POLICY_ISOLATE, file=str(reset_file),
                     why=f"process {pid} still on the chip after {process_deadline:g} s")
            return
        time.sleep(POLL_INTERVAL)
    for rank, pid in sorted(on_chip.items()):
        emit("process left the chip", rank=rank, pid=pid)
    time.sleep(hold)
    write_plugin_episode(reset_file, ranks, outcome, error_code, policy)
    for rank in ranks:
        emit(outcome, rank=rank, file=str(reset_file))


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process here (a zombie is gone: it holds no chip)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
