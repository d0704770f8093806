"""In-memory checkpoints: double-buffered, checksummed snapshots and a dying-gasp dump.

A rank keeps the state of its last completed steps in host memory so a rollback
costs a memcpy, not a disk read. :class:`SnapshotStore` holds two slots
(:class:`mindft.snapshot.slots.Slot`): a capture always writes into the slot that does not hold the
snapshot to keep, so a capture that dies half-way leaves the previous snapshot intact. The
copy runs in a background thread into buffers reused from one step to the next, and each
array is checksummed chunk by chunk right after it is copied (:func:`mindft.snapshot.slots.fill`).

Replicas (:mod:`mindft.replica`) are sent from a slot as it is (:meth:`SnapshotStore.view`,
with the checksums the capture recorded) and checked for being overwritten meanwhile
(:meth:`SnapshotStore.intact`); :meth:`SnapshotStore.adopt` installs one fetched back.
:meth:`SnapshotStore.dump` writes MindSpore's ``.ckpt`` format without importing
MindSpore (:mod:`mindft.snapshot.ckpt`), so a job that cannot recover still leaves a loadable checkpoint.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from mindft.snapshot.ckpt import atomic_write, write_ckpt
from mindft.snapshot.slots import CHECKSUM, HASHERS, Slot, fill, read_manifest

log = logging.getLogger(__name__)


class SnapshotError(RuntimeError):
    """No usable snapshot: none held, all corrupt, a refused replica, or a failed capture/dump."""


@dataclass(frozen=True)
class Snapshot:
    """One rank's state at the end of ``step``.

    ``arrays`` are read-only views into the store (or into received frames): copy
    them into the model before the store captures twice more.
    """

    step: int
    arrays: Mapping[str, np.ndarray]
    meta: Mapping[str, Any] = field(default_factory=dict)
    checksums: Mapping[str, int] = field(default_factory=dict)
    algorithm: str = CHECKSUM  # how ``checksums`` were computed


@dataclass(frozen=True)
class SlotView:
    """A complete snapshot as read-only views of the slot that holds it (:meth:`SnapshotStore.view`)."""

    seq: int
    step: int
    arrays: Mapping[str, np.ndarray]
    checksums: Mapping[str, int]
    meta: Mapping[str, Any]
    algorithm: str


def newest_step(home: Path) -> int:
    """The step of the newest complete snapshot a :class:`SnapshotStore` at ``home`` holds, read
    from its slots' manifests without mapping them (-1: none)."""
    manifests = (read_manifest(Path(home) / f"slot{i}.json") for i in range(2))
    return max((manifest.step for manifest in manifests if manifest is not None), default=-1)


def _view(slot: Slot) -> SlotView:
    return SlotView(slot.seq, slot.step, {name: _readonly(b) for name, b in slot.buffers.items()},
                    dict(slot.checksums), dict(slot.meta), slot.algorithm)


def _as_sources(arrays: Mapping[str, Any]) -> Dict[str, np.ndarray]:
    sources = {}
    for name, value in arrays.items():
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        if array.dtype.hasobject:
            raise SnapshotError(f"array {name!r} has dtype {array.dtype}; snapshots hold numeric arrays only")
        sources[str(name)] = array
    return sources


def _readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class SnapshotStore:
    """Two host-memory snapshots of one rank's training state (see the module docstring).

    One thread captures (the training thread); restore may run from any thread.
    With ``home`` (a directory on tmpfs that the node agent owns) the two slots are files
    there, mapped into this process: captures go straight into that shared memory, and
    a restarted process of the same rank finds the complete snapshots again
    (``resume=True``; otherwise what is there is discarded).
    """

    def __init__(self, home: Optional[Path] = None, resume: bool = False) -> None:
        if home is not None:
            try:
                Path(home).mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise SnapshotError(f"MINDFT_STATE_DIR: cannot create {home}: {error.strerror or error}") from error
        self._slots = tuple(Slot(None if home is None else Path(home) / f"slot{i}.bin") for i in range(2))
        self._keep = 1  # the slot a capture must not touch: the newest, or the one last restored
        for index, slot in enumerate(self._slots):
            if home is not None and not (resume and slot.load()):
                slot.forget()
        held = [(slot.step, index) for index, slot in enumerate(self._slots) if slot.complete]
        if held:
            self._keep = max(held)[1]
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mindft-snapshot")
        self._future: Optional[Future] = None
        self._pending_step = -1
        self._completed = 0  # captures and adopts completed, so restore can tell if one overtook it
        for index, slot in enumerate(self._slots):
            slot.seq = index + 1
        self._claims = len(self._slots)  # the seq of the newest claim
        self.last_fill_seconds = 0.0  # how long the newest capture's copy and checksum took
        self.on_complete: Optional[Any] = None  # called from the copy thread when a capture completes

    def capture(self, step: int, arrays: Mapping[str, Any], meta: Optional[Mapping[str, Any]] = None) -> int:
        """Start copying ``arrays`` (and JSON-able ``meta``) as the snapshot of ``step`` in the background.

        Blocks only while the previous capture is still running. Do not mutate
        ``arrays`` until :meth:`wait` returns: the copy reads them meanwhile.
        Returns the capture's sequence number (:attr:`SlotView.seq` once it completes).
        """
        sources = _as_sources(arrays)
        meta = json.loads(json.dumps(dict(meta or {})))  # a private copy, and fails now if not JSON-able
        self._join()
        index, slot = self._claim()
        slot.reserve(sources)
        self._pending_step = step
        self._future = self._pool.submit(self._fill_slot, index, step, sources, meta, CHECKSUM, None)
        return slot.seq

    def view(self) -> Optional[SlotView]:
        """The snapshot to keep (the newest, or the one last restored) as read-only views of its slot.

        Nothing is copied: the views are valid while :meth:`intact` says so (a capture
        overwrites the slot two captures later; check after reading, not before).
        """
        with self._cond:
            slot = self._slots[self._keep]
            return _view(slot) if slot.complete else None

    def views(self) -> List[SlotView]:
        """Every complete snapshot held, as :meth:`view` gives the one to keep."""
        with self._cond:
            return [_view(slot) for slot in self._slots if slot.complete]

    def intact(self, seq: int) -> bool:
        """True while the snapshot of capture ``seq`` is held, unchanged since :meth:`view` returned it."""
        with self._cond:
            return any(slot.seq == seq and slot.complete for slot in self._slots)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the capture in flight completed; raise :class:`SnapshotError` if it failed."""
        future = self._future
        if future is None:
            return
        try:
            error = future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"capture of step {self._pending_step} still running after {timeout} s") from None
        if error is not None:
            raise SnapshotError(f"capture of step {self._pending_step} failed: {error!r}; "
                                f"the previous snapshot is intact (steps held: {self.steps})") from error

    def restore(self, step: Optional[int] = None, into: Optional[Mapping[str, np.ndarray]] = None) -> Snapshot:
        """The newest snapshot at or below ``step`` whose checksums verify.

        A snapshot that fails verification is dropped and the older one is tried.
        With ``into`` (arrays with the snapshot's names, shapes and dtypes) the data
        is copied there while it is verified, which is faster than verifying and
        then copying; on :class:`SnapshotError` ``into`` may hold garbage. The
        snapshot returned is the one the next capture will not overwrite.
        """
        with self._cond:
            candidates = sorted(((slot.step, index) for index, slot in enumerate(self._slots)
                                 if slot.complete and (step is None or slot.step <= step)), reverse=True)
            for _, index in candidates:
                self._slots[index].readers += 1
            completed = self._completed
        refused = []
        try:
            for held, index in candidates:
                slot = self._slots[index]
                if into is not None:
                    _check_like(slot.buffers, into)
                bad = self._verify(slot, into)
                if not bad:
                    with self._cond:
                        if self._completed == completed:  # else a newer capture landed: keep that one
                            self._keep = index
                    log.debug("restored the snapshot of step %d (steps held: %s)", held, self.steps)
                    return Snapshot(held, {name: _readonly(b) for name, b in slot.buffers.items()},
                                    dict(slot.meta), dict(slot.checksums), slot.algorithm)
                with self._cond:
                    slot.complete = False
                refused.append(f"step {held} (checksum mismatch in {', '.join(bad)})")
                log.error("snapshot of step %d failed verification in %s; dropped it", held, ", ".join(bad))
        finally:
            with self._cond:
                for _, index in candidates:
                    self._slots[index].readers -= 1
                self._cond.notify_all()
        wanted = "any step" if step is None else f"step <= {step}"
        raise SnapshotError(f"no verified snapshot for {wanted}; refused: {'; '.join(refused) or 'none held'}")

    def adopt(self, snapshot: Snapshot) -> None:
        """Install ``snapshot`` (e.g. a fetched replica) as complete, after verifying its checksums."""
        self._join()
        index, slot = self._claim()
        sources = _as_sources(snapshot.arrays)
        slot.reserve(sources)
        if snapshot.algorithm not in HASHERS:
            raise SnapshotError(f"snapshot checksummed with {snapshot.algorithm!r}, unknown here "
                                f"(known: {sorted(HASHERS)})")
        self._fill_slot(index, snapshot.step, sources, json.loads(json.dumps(dict(snapshot.meta))),
                        snapshot.algorithm, snapshot.checksums)

    @property
    def steps(self) -> Tuple[int, ...]:
        """Steps of the complete snapshots held, ascending."""
        with self._cond:
            return tuple(sorted(slot.step for slot in self._slots if slot.complete))

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers (at most two copies of the state)."""
        with self._cond:
            return sum(buffer.nbytes for slot in self._slots for buffer in slot.buffers.values())

    def dump(self, directory: Path, rank: int, world_size: int, step: Optional[int] = None) -> Path:
        """Write the snapshot of ``step`` (default or not held: the newest verified one) as a
        MindSpore ``.ckpt`` plus a JSON manifest.

        Both files appear atomically under their final names (the manifest last),
        so a dump cut short leaves only a hidden temporary file. Returns the
        checkpoint's path; every failure is a :class:`SnapshotError`.
        """
        self._join()
        held = self.steps
        if step is not None and step >= 0 and step not in held:
            log.error("rank %d asked to dump step %d but holds %s: dumping the newest", rank, step, list(held))
            step = None
        snapshot = self.restore(step if step is not None and step >= 0 else None)
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SnapshotError(f"dump of step {snapshot.step}: cannot create directory {directory}: "
                                f"{error.strerror or error}") from error
        path = directory / f"mindft-rank{rank}-step{snapshot.step}.ckpt"
        manifest = {
            "format": "mindspore-ckpt", "file": path.name, "step": snapshot.step, "rank": rank,
            "world_size": world_size, "meta": dict(snapshot.meta), "checksum_algorithm": snapshot.algorithm,
            "checksums": dict(snapshot.checksums),
            "arrays": {name: {"dtype": array.dtype.str, "shape": list(array.shape)}
                       for name, array in snapshot.arrays.items()},
            "created": time.time(),
        }
        try:
            atomic_write(path, lambda handle: write_ckpt(handle, snapshot.arrays))
            atomic_write(path.with_suffix(".json"),
                         lambda handle: handle.write(json.dumps(manifest, indent=1).encode()))
        except (OSError, ValueError) as error:  # ValueError: a dtype the .ckpt format has no type for
            raise SnapshotError(f"dump of step {snapshot.step} to {directory} failed: {error}") from error
        log.warning("rank %d dumped the snapshot of step %d to %s", rank, snapshot.step, path)
        return path

    def close(self) -> None:
        """Finish the capture in flight, stop the copy thread and free the buffers (files in ``home`` stay)."""
        self._join()
        self._pool.shutdown(wait=True)
        with self._cond:
            for slot in self._slots:
                slot.buffers, slot.complete = {}, False
                slot.seq = -1  # a replica sender still holding views must not send them on

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _join(self) -> None:
        """Wait for the capture in flight; its failure was logged and is reported by wait()."""
        if self._future is not None:
            self._future.exception()

    def _claim(self) -> Tuple[int, Slot]:
        """Take the slot a capture may overwrite, once no restore is reading it."""
        with self._cond:
            index = 1 - self._keep
            slot = self._slots[index]
            while slot.readers:
                self._cond.wait()
            slot.forget()
            self._claims += 1
            slot.seq = self._claims
            return index, slot

    def _fill_slot(self, index: int, step: int, sources: Mapping[str, np.ndarray], meta: Dict[str, Any],
                   algorithm: str, expected: Optional[Mapping[str, int]]) -> None:
        slot = self._slots[index]
        started = time.perf_counter()
        try:
            hasher = HASHERS[algorithm]
            checksums = {name: fill(slot.buffers[name], src, hasher) for name, src in sources.items()}
            self.last_fill_seconds = time.perf_counter() - started
        except BaseException:
            log.exception("capture of step %d failed; keeping the previous snapshot", step)
            raise
        if expected is not None and dict(expected) != checksums:
            bad = sorted(name for name in checksums if checksums[name] != expected.get(name))
            raise SnapshotError(f"snapshot of step {step} does not match its checksums "
                                f"({', '.join(bad) or 'different array names'})")
        slot.step, slot.meta, slot.checksums, slot.algorithm = step, meta, checksums, algorithm
        slot.record()
        with self._cond:
            slot.complete = True
            self._completed += 1
            self._keep = index
        log.debug("captured step %d (%d bytes)", step, sum(b.nbytes for b in slot.buffers.values()))
        notify = self.on_complete
        if notify is not None:
            notify()

    def _verify(self, slot: Slot, into: Optional[Mapping[str, np.ndarray]]) -> List[str]:
        """Names whose data does not match the recorded checksum (copying into ``into`` meanwhile)."""
        hasher = HASHERS[slot.algorithm]
        return [name for name, buffer in slot.buffers.items()
                if (fill(into[name], buffer, hasher) if into is not None else fill(buffer, None, hasher))
                != slot.checksums.get(name)]


def _check_like(buffers: Mapping[str, np.ndarray], into: Mapping[str, np.ndarray]) -> None:
    if set(buffers) != set(into):
        raise SnapshotError(f"restore(into=...): names differ from the snapshot's: missing "
                            f"{sorted(set(buffers) - set(into))}, unexpected {sorted(set(into) - set(buffers))}")
    for name, buffer in buffers.items():
        target = into[name]
        if not isinstance(target, np.ndarray) or target.shape != buffer.shape or target.dtype != buffer.dtype:
            raise SnapshotError(f"restore(into=...): {name!r} must be an array of shape {buffer.shape} "
                                f"and dtype {buffer.dtype}, got {getattr(target, 'shape', type(target))}")
