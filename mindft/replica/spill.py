"""A held replica moving to disk while the next one of its rank arrives into its memory.

With a spill directory (:func:`replica_spill`, on disk: not tmpfs, see
:func:`in_memory_filesystem`) a keeper moves the replica it holds to a file there as the new
one arrives, piece by piece (:class:`Spill`), and the new one takes its memory right behind
the write: memory holds one replica per rank, never two, the write overlaps the transfer, and
a push cut short leaves the old replica on disk up to where it got and in memory after.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from mindft.snapshot.store import SnapshotError
from mindft.observe.threadcpu import ThreadCpu

log = logging.getLogger(__name__)

SPILL_DIRECTORY = "replica-spill"  # in MINDFT_DUMP_DIR: one directory per keeper
SPILL_PIECE = 8 * 1024 * 1024  # bytes a keeper moving a replica to disk writes between syncs


def replica_spill(dump_dir: Path, keeper: str) -> Path:
    """Where a keeper moves a replica while the next one arrives: beside the dying-gasp
    checkpoints (``MINDFT_DUMP_DIR``), on disk; one directory per keeper (``node<N>``, ``rank<R>``)."""
    return Path(dump_dir) / SPILL_DIRECTORY / keeper


def in_memory_filesystem(path: Path) -> bool:
    """True when ``path`` lies on tmpfs or ramfs (its mount in /proc/mounts): a file there is memory."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return False
    target = os.path.realpath(path)
    under = [(point, kind) for point, kind in mounts
             if target == point or target.startswith(point.rstrip("/") + "/")]
    return bool(under) and max(under, key=lambda mount: len(mount[0]))[1] in ("tmpfs", "ramfs")


class Spill:
    """A held replica moving to disk while the next one arrives, in a thread of its own: its own
    arrays, end to end in header order, written piece by piece; each piece synced and dropped
    from the page cache before ``synced`` (bytes) passes it. Below ``synced`` the arriving
    replica may take the memory (the keeper waits for it before writing a part), so the write
    and the transfer overlap and memory holds one replica throughout."""

    def __init__(self, path: Path, arrays: List[Tuple[str, np.ndarray]], changed: threading.Condition,
                 done: Callable[[], None], cpu: Optional[ThreadCpu]) -> None:
        self.path = path
        self.offsets: Dict[str, int] = {}
        self.sizes: Dict[str, int] = {}
        self.total = 0
        for name, array in arrays:
            self.offsets[name], self.sizes[name] = self.total, array.nbytes
            self.total += array.nbytes
        self.synced = 0
        self.failed: Optional[str] = None
        self._arrays = arrays
        self._changed = changed  # built on the keeper's lock
        self._done = done
        self._cpu = cpu
        self._cancelled = False
        self._started = time.perf_counter()
        self.thread = threading.Thread(target=self._counted_write, name="mindft-spill", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        """Stop writing (the replica is no longer held); the caller removes the file."""
        self._cancelled = True

    def read(self, name: str, memory: Optional[np.ndarray], handle: Any) -> bytes:
        """Array ``name`` of the replica being moved: what is synced from the file, the rest
        from ``memory`` (the keeper's lock held, so ``synced`` stands still)."""
        size, start = self.sizes[name], self.offsets[name]
        on_disk = min(max(self.synced - start, 0), size)
        data = os.pread(handle.fileno(), on_disk, start) if on_disk else b""
        if len(data) != on_disk:
            raise SnapshotError(f"spill file {self.path}: {len(data)} of {on_disk} bytes of {name!r} read back")
        if on_disk < size:
            data += memory.reshape(-1).view(np.uint8)[on_disk:].tobytes()
        return data

    def _counted_write(self) -> None:
        try:
            self._write()
        finally:
            if self._cpu is not None:
                self._cpu.add_this_thread()

    def _write(self) -> None:
        arrays, self._arrays = self._arrays, []  # the keeper frees the memory once it is on disk
        try:
            with open(self.path, "wb") as handle:
                descriptor, at = handle.fileno(), 0
                for _, array in arrays:
                    data = array.reshape(-1).view(np.uint8)
                    for start in range(0, data.size, SPILL_PIECE):
                        if self._cancelled:
                            return
                        piece = data[start:start + SPILL_PIECE]
                        handle.write(piece)
                        handle.flush()
                        os.fdatasync(descriptor)
                        # On disk: the page cache need not keep a copy in memory.
                        os.posix_fadvise(descriptor, at, piece.size, os.POSIX_FADV_DONTNEED)
                        at += piece.size
                        with self._changed:
                            self.synced = at
                            self._changed.notify_all()
        except OSError as error:
            with self._changed:
                self.failed = f"{error.strerror or error}: {self.path}"
                self._changed.notify_all()
            return
        log.debug("moved a replica to %s in %.3f s", self.path, time.perf_counter() - self._started)
        self._done()
