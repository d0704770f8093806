"""In-memory checkpoints: double-buffered, checksummed snapshots, a peer replica, a dying-gasp dump.

A rank keeps the state of its last completed steps in host memory so a rollback
costs a memcpy, not a disk read. :class:`SnapshotStore` holds two slots: a
capture always writes into the slot that does not hold the snapshot to keep, so
a capture that dies half-way leaves the previous snapshot intact. The copy runs
in a background thread into buffers reused from one step to the next, and each
array is checksummed chunk by chunk right after it is copied, while the chunk is
still in cache, which makes the checksum nearly free.

Replicas (:mod:`mindft.replication`) are sent from a slot as it is (:meth:`SnapshotStore.view`,
with the checksums the capture recorded) and checked for being overwritten meanwhile
(:meth:`SnapshotStore.intact`); :func:`fetch_replica` brings one back and verifies it, and
:func:`push_replica` sends one in a single request (for tools and tests; ranks stream theirs).
:meth:`SnapshotStore.dump` writes MindSpore's ``.ckpt`` format without importing
MindSpore, so a job that cannot recover still leaves a loadable checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import zmq

from mindft.keys import CurveKeys, secure_client

try:  # xxh3 is ~10x faster than zlib.crc32 (bench/snapshot.py); crc32 keeps mindft working without it
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

log = logging.getLogger(__name__)

REPLICA_VERSION = 2  # 2: a streamed push waits for the keeper's answer to begin
# 512 KiB chunks fit in L2, so hashing a chunk right after copying it reads from cache.
_CHUNK = 512 * 1024
# MindSpore slices parameters larger than 512 MiB into several records with the same tag.
_CKPT_SLICE = 512 * 1024 * 1024

_CKPT_TYPES = {
    np.dtype(np.bool_): "Bool", np.dtype(np.int8): "Int8", np.dtype(np.uint8): "UInt8",
    np.dtype(np.int16): "Int16", np.dtype(np.uint16): "UInt16", np.dtype(np.int32): "Int32",
    np.dtype(np.uint32): "UInt32", np.dtype(np.int64): "Int64", np.dtype(np.uint64): "UInt64",
    np.dtype(np.float16): "Float16", np.dtype(np.float32): "Float32", np.dtype(np.float64): "Float64",
}


class SnapshotError(RuntimeError):
    """No usable snapshot: none held, all corrupt, a refused replica, or a failed capture/dump."""


class _Crc32:
    """zlib.crc32 behind the streaming interface of xxhash's hashers."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


_HASHERS: Dict[str, Any] = {"crc32": _Crc32}
if xxhash is not None:
    _HASHERS["xxh3_64"] = xxhash.xxh3_64
CHECKSUM = "xxh3_64" if xxhash is not None else "crc32"


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


_SIZE_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}


def size_text(nbytes: int) -> str:
    """``nbytes`` for people: 512 B, 1.5 KiB, 96.0 MiB."""
    for unit, scale in _SIZE_UNITS.items():
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def size_from_text(text: str) -> float:
    """The bytes a :func:`size_text` stands for (to the rounding it printed)."""
    number, unit = text.split()
    return float(number) * (1 if unit == "B" else _SIZE_UNITS[unit])


def _view(slot: _Slot) -> SlotView:
    return SlotView(slot.seq, slot.step, {name: _readonly(b) for name, b in slot.buffers.items()},
                    dict(slot.checksums), dict(slot.meta), slot.algorithm)


def checksum(array: np.ndarray, algorithm: str = CHECKSUM) -> int:
    """The checksum mindft records for ``array``'s bytes (C order)."""
    return _fill(np.ascontiguousarray(array), None, _HASHERS[algorithm])


def _flat_bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _fill(dst: np.ndarray, src: Optional[np.ndarray], hasher: Any) -> int:
    """Copy ``src`` into ``dst`` (when given) and return the checksum of what ``dst`` now holds."""
    state = hasher()
    if src is not None and not (src.flags.c_contiguous and dst.flags.c_contiguous):
        np.copyto(dst, src, casting="no")  # rare: chunking needs flat views of both
        dst, src = (dst if dst.flags.c_contiguous else src), None
    out = _flat_bytes(dst)
    inp = _flat_bytes(src) if src is not None else None
    for start in range(0, out.size, _CHUNK):
        chunk = out[start:start + _CHUNK]
        if inp is not None:
            np.copyto(chunk, inp[start:start + _CHUNK])
        state.update(chunk)
    return state.intdigest()


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


_ALIGN = 64  # each array of a slot file starts on a cache line


@dataclass(frozen=True)
class SlotManifest:
    """A slot file's manifest (``slot<i>.json`` beside ``slot<i>.bin``, written by
    :meth:`_Slot.record` once the snapshot is complete), as read once."""

    path: Path
    identity: Tuple[int, int, int, bytes]  # :func:`manifest_identity` before it was read
    step: int
    algorithm: str
    meta: Dict[str, Any]
    layout: Tuple[Tuple[str, str, Tuple[int, ...], int], ...]  # (name, dtype.str, shape, offset in the file)
    checksums: Dict[str, int]

    @property
    def data(self) -> Path:
        return self.path.with_suffix(".bin")

    def intact(self) -> bool:
        """The slot still holds this snapshot (a capture that overwrites it removes the manifest first)."""
        return manifest_identity(self.path) == self.identity


def read_manifest(path: Path) -> Optional[SlotManifest]:
    """The complete snapshot a slot file holds; None if there is none (or it is garbage)."""
    identity = manifest_identity(path)
    if identity is None:
        return None
    try:
        body = json.loads(path.read_text())
        layout = tuple((str(n), np.dtype(d).str, tuple(int(x) for x in s), int(o)) for n, d, s, o in body["layout"])
        checksums = {name: int(body["checksums"][name]) for name, _, _, _ in layout}
        return SlotManifest(path, identity, int(body["step"]), str(body.get("algorithm")),
                            dict(body.get("meta", {})), layout, checksums)
    except FileNotFoundError:
        return None  # overwritten since
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("ignoring the snapshot in %s: %s", path, error)
        return None


def manifest_identity(path: Path) -> Optional[Tuple[int, int, int, bytes]]:
    """What tells one manifest from the next: file timestamps are coarse (a clock tick) and tmpfs
    reuses inode numbers, so two fast captures can look alike; the head of the JSON holds the step."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        head = os.read(fd, 64)
    except OSError:
        return None
    finally:
        os.close(fd)
    return info.st_ino, info.st_mtime_ns, info.st_size, head


class _Slot:
    """One of the two buffers; ``complete`` only once copy and checksums finished.

    With a ``path`` the buffers live in that file (on tmpfs: shared memory the node agent
    owns, so they outlive the process) and ``path.json`` records a complete snapshot.
    """

    def __init__(self, path: Optional[Path] = None) -> None:
        self.path = path
        self.buffers: Dict[str, np.ndarray] = {}
        self.step = -1
        self.meta: Dict[str, Any] = {}
        self.checksums: Dict[str, int] = {}
        self.algorithm = CHECKSUM
        self.complete = False
        self.readers = 0  # restores verifying this slot; a capture must not overwrite it meanwhile
        self.seq = 0  # which capture claimed the slot last: a sender of its bytes checks it did not change
        self._layout: List[Tuple[str, str, Tuple[int, ...], int]] = []

    @property
    def manifest(self) -> Optional[Path]:
        return None if self.path is None else self.path.with_suffix(".json")

    def reserve(self, sources: Mapping[str, np.ndarray]) -> None:
        """Make ``buffers`` match ``sources``, reusing every buffer whose shape and dtype still fit."""
        self.prepare([(name, src.dtype.str, tuple(src.shape)) for name, src in sources.items()])

    def prepare(self, wanted: List[Tuple[str, str, Tuple[int, ...]]]) -> None:
        """Make ``buffers`` hold arrays of these (name, dtype, shape), reusing what still fits."""
        if self.path is not None:
            self._map(wanted)
            return
        old, new = self.buffers, {}
        for name, dtype, shape in wanted:
            buffer = old.get(name)
            fits = buffer is not None and buffer.shape == tuple(shape) and buffer.dtype == np.dtype(dtype)
            new[name] = buffer if fits else np.empty(shape, dtype)
        self.buffers = new  # one assignment: nbytes may read it from another thread

    def release(self) -> None:
        """Hold nothing any more: forget the snapshot and free its memory (and its file)."""
        self.forget()
        self.buffers, self._layout = {}, []
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def _map(self, wanted: List[Tuple[str, str, Tuple[int, ...]]]) -> None:
        layout, offset = [], 0
        for name, dtype, shape in wanted:
            layout.append((name, dtype, shape, offset))
            offset += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        if layout == self._layout and self.buffers:
            return
        size = max(offset, _ALIGN)
        try:
            resized = os.stat(self.path).st_size != size
        except FileNotFoundError:
            resized = False
        if resized:
            # Never shrink a file another mapping may still read (a replica being sent from it):
            # reading a mapped page past the end of its file is SIGBUS. A new file leaves the
            # old one to whoever still maps it.
            self.path.unlink()
        with open(self.path, "a+b") as handle:
            if os.fstat(handle.fileno()).st_size != size:
                handle.truncate(size)
        memory = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(size,))
        self.buffers = {name: memory[start:start + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize]
                        .view(np.dtype(dtype)).reshape(shape) for name, dtype, shape, start in layout}
        self._layout = layout

    def forget(self) -> None:
        """The slot is about to be overwritten: it no longer holds a snapshot, on disk either."""
        self.complete = False
        if self.manifest is not None:
            self.manifest.unlink(missing_ok=True)

    def record(self) -> None:
        """Write the manifest that makes this slot's file a complete snapshot for a later process."""
        if self.manifest is None:
            return
        body = {"step": self.step, "meta": self.meta, "checksums": self.checksums, "algorithm": self.algorithm,
                "layout": [[name, dtype, list(shape), start] for name, dtype, shape, start in self._layout]}
        temporary = self.manifest.with_name(f".{self.manifest.name}.tmp")
        temporary.write_text(json.dumps(body))
        os.replace(temporary, self.manifest)

    def load(self) -> bool:
        """Map a complete snapshot a previous process of this rank left here; False if there is none."""
        manifest = read_manifest(self.manifest)
        if manifest is None:
            return False
        try:
            self._map([(name, dtype, shape) for name, dtype, shape, _ in manifest.layout])
        except (OSError, ValueError) as error:
            log.warning("ignoring the snapshot in %s: %s", self.path, error)
            return False
        self.step, self.meta, self.algorithm = manifest.step, manifest.meta, manifest.algorithm
        self.checksums = dict(manifest.checksums)
        self.complete = self.algorithm in _HASHERS
        return self.complete


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
        self._slots = tuple(_Slot(None if home is None else Path(home) / f"slot{i}.bin") for i in range(2))
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
        if snapshot.algorithm not in _HASHERS:
            raise SnapshotError(f"snapshot checksummed with {snapshot.algorithm!r}, unknown here "
                                f"(known: {sorted(_HASHERS)})")
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
            _atomic_write(path, lambda handle: _write_ckpt(handle, snapshot.arrays))
            _atomic_write(path.with_suffix(".json"),
                          lambda handle: handle.write(json.dumps(manifest, indent=1).encode()))
        except OSError as error:
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

    def _claim(self) -> Tuple[int, _Slot]:
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
            hasher = _HASHERS[algorithm]
            checksums = {name: _fill(slot.buffers[name], src, hasher) for name, src in sources.items()}
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

    def _verify(self, slot: _Slot, into: Optional[Mapping[str, np.ndarray]]) -> List[str]:
        """Names whose data does not match the recorded checksum (copying into ``into`` meanwhile)."""
        hasher = _HASHERS[slot.algorithm]
        return [name for name, buffer in slot.buffers.items()
                if (_fill(into[name], buffer, hasher) if into is not None else _fill(buffer, None, hasher))
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


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _write_ckpt(handle: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Stream ``arrays`` as MindSpore's ``Checkpoint`` protobuf (mindspore/train/checkpoint.proto).

    Checkpoint{repeated Value value = 1}; Value{string tag = 1; TensorProto tensor = 2};
    TensorProto{repeated int64 dims = 1; string tensor_type = 2; bytes tensor_content = 3}.
    Each record is a serialized one-value Checkpoint; concatenated, they parse as
    one message. Tensor bytes go from the buffer to the file without a copy.
    """
    for name, array in arrays.items():
        tensor_type = _CKPT_TYPES.get(array.dtype.newbyteorder("="))
        if tensor_type is None or not array.dtype.isnative:
            raise SnapshotError(f"array {name!r}: dtype {array.dtype} has no MindSpore checkpoint type")
        data = _flat_bytes(np.ascontiguousarray(array))
        # Proto2 repeated scalars are not packed: one (field 1, varint) pair per dimension.
        head = b"".join(b"\x08" + _varint(dim) for dim in array.shape) + _field(2, tensor_type.encode())
        for start in range(0, max(data.size, 1), _CKPT_SLICE):
            content = data[start:start + _CKPT_SLICE]
            tensor_head = head + _varint(3 << 3 | 2) + _varint(content.size)
            tensor_size = len(tensor_head) + content.size
            value_head = _field(1, name.encode()) + _varint(2 << 3 | 2) + _varint(tensor_size)
            handle.write(_varint(1 << 3 | 2) + _varint(len(value_head) + tensor_size) + value_head + tensor_head)
            handle.write(memoryview(content))


def _atomic_write(path: Path, write: Any) -> None:
    """Write ``path`` through a hidden temporary file: fsync, rename, fsync the directory."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@dataclass(frozen=True)
class ReplicaHeader:
    """The JSON frame in front of a replica's array frames: what the bytes are and how to check them."""

    owner_rank: int
    step: int
    arrays: Tuple[Tuple[str, str, Tuple[int, ...], int], ...]  # (name, dtype.str, shape, checksum)
    meta: Mapping[str, Any] = field(default_factory=dict)
    algorithm: str = CHECKSUM
    version: int = REPLICA_VERSION

    def encode(self) -> bytes:
        """The header as one JSON frame."""
        return json.dumps({"version": self.version, "owner_rank": self.owner_rank, "step": self.step,
                           "algorithm": self.algorithm, "meta": dict(self.meta),
                           "arrays": [list(spec) for spec in self.arrays]}).encode()

    @classmethod
    def decode(cls, frame: bytes) -> ReplicaHeader:
        """Parse a header; :class:`SnapshotError` for garbage or a version this mindft does not speak."""
        try:
            data = json.loads(frame)
            version = data["version"]
            if version != REPLICA_VERSION:
                raise SnapshotError(f"replica format version {version!r}; this mindft speaks {REPLICA_VERSION}")
            arrays = tuple((str(name), np.dtype(dtype).str, tuple(int(d) for d in shape), int(value))
                           for name, dtype, shape, value in data["arrays"])
            if any(np.dtype(dtype).hasobject for _, dtype, _, _ in arrays):
                raise SnapshotError("replica header names an object dtype")
            return cls(int(data["owner_rank"]), int(data["step"]), arrays, dict(data["meta"]),
                       str(data["algorithm"]), version)
        except SnapshotError:
            raise
        except (ValueError, KeyError, TypeError) as error:
            raise SnapshotError(f"garbage replica header ({error!r})") from None


def _check_frames(header: ReplicaHeader, frames: List[Any]) -> None:
    if len(frames) != len(header.arrays):
        raise SnapshotError(f"replica of step {header.step} has {len(frames)} array frames, "
                            f"its header lists {len(header.arrays)}")
    for (name, dtype, shape, _), frame in zip(header.arrays, frames):
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if len(frame) != size:
            raise SnapshotError(f"replica of step {header.step}: {name!r} has {len(frame)} bytes, expected {size}")


def _request(endpoint: str, keys: Optional[CurveKeys], timeout: float, frames: List[Any]) -> List[Any]:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.sndhwm = socket.rcvhwm = 0
    socket.sndtimeo = int(timeout * 1000)
    secure_client(socket, keys)
    try:
        socket.connect(endpoint)
        socket.send_multipart(frames, copy=False)
        if not socket.poll(int(timeout * 1000)):
            raise SnapshotError(f"no answer from the replica server at {endpoint} within {timeout} s "
                                f"(it is down, or it refused our key)")
        reply = socket.recv_multipart(copy=False)
    except zmq.ZMQError as error:
        raise SnapshotError(f"replica server at {endpoint}: {error}") from error
    finally:
        socket.close(linger=0)
    if reply[0].bytes == b"error":
        raise SnapshotError(f"replica server at {endpoint} refused: {reply[1].bytes.decode(errors='replace')}")
    return reply


def push_replica(endpoint: str, owner_rank: int, snapshot: Snapshot, keys: Optional[CurveKeys],
                 timeout: float) -> None:
    """Send ``snapshot`` of ``owner_rank`` to a :class:`~mindft.replication.Keeper` in one request
    (a socket of its own); returns once it is held. For tools and tests: ranks and node agents
    stream their replicas (:mod:`mindft.replication`)."""
    # ascontiguousarray turns a 0-d array into shape (1,): keep the original shape.
    arrays = {name: np.ascontiguousarray(array).reshape(array.shape)
              for name, array in snapshot.arrays.items()}
    missing = sorted(set(arrays) - set(snapshot.checksums))
    if missing:
        raise SnapshotError(f"snapshot of step {snapshot.step} has no checksum for {missing}")
    header = ReplicaHeader(owner_rank, snapshot.step, tuple(
        (name, array.dtype.str, array.shape, int(snapshot.checksums[name])) for name, array in arrays.items()),
        dict(snapshot.meta), snapshot.algorithm)
    reply = _request(endpoint, keys, timeout,
                     [b"push", header.encode(), *(_flat_bytes(array) for array in arrays.values())])
    if reply[0].bytes != b"ok":
        raise SnapshotError(f"replica keeper at {endpoint} answered {reply[0].bytes[:32]!r} to a push")


def fetch_replica(endpoint: str, owner_rank: int, keys: Optional[CurveKeys], timeout: float,
                  min_step: Optional[int] = None) -> Snapshot:
    """Fetch ``owner_rank``'s replica from its buddy and verify it.

    :class:`SnapshotError` if none is held, it is older than ``min_step`` (stale),
    belongs to another rank, or fails its checksums (corrupt). The arrays are
    read-only views of the received frames; :meth:`SnapshotStore.adopt` copies them.
    """
    reply = _request(endpoint, keys, timeout, [b"fetch", json.dumps({"owner_rank": owner_rank}).encode()])
    if reply[0].bytes != b"replica" or len(reply) < 2:
        raise SnapshotError(f"replica server at {endpoint} answered {reply[0].bytes[:32]!r} to a fetch")
    header = ReplicaHeader.decode(reply[1].bytes)
    frames = reply[2:]
    _check_frames(header, frames)
    if header.owner_rank != owner_rank:
        raise SnapshotError(f"asked {endpoint} for rank {owner_rank}'s replica, got rank {header.owner_rank}'s")
    if min_step is not None and header.step < min_step:
        raise SnapshotError(f"stale replica of rank {owner_rank}: step {header.step}, need >= {min_step}")
    if header.algorithm not in _HASHERS:
        raise SnapshotError(f"replica checksummed with {header.algorithm!r}; install the package "
                            f"providing it (known: {sorted(_HASHERS)})")
    arrays, checksums, bad = {}, {}, []
    for (name, dtype, shape, expected), frame in zip(header.arrays, frames):
        array = np.frombuffer(frame.buffer, dtype=dtype).reshape(shape)
        if _fill(array, None, _HASHERS[header.algorithm]) != expected:
            bad.append(name)
        arrays[name], checksums[name] = array, expected
    if bad:
        raise SnapshotError(f"corrupt replica of rank {owner_rank}, step {header.step}: "
                            f"checksum mismatch in {', '.join(bad)}")
    log.info("fetched the replica of rank %d, step %d from %s", owner_rank, header.step, endpoint)
    return Snapshot(header.step, arrays, header.meta, checksums, header.algorithm)
