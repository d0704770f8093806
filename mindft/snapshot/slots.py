"""Snapshot slots and their checksums: the buffers a snapshot lives in, and how it is checked.

A :class:`Slot` is one of a store's two buffers (in this process's memory, or a file on tmpfs the
node agent owns, with a JSON manifest once the snapshot in it is complete: :class:`SlotManifest`,
:func:`read_manifest`). Arrays are copied into a slot and checksummed chunk by chunk right after
each chunk is copied, while it is still in cache (:func:`fill`), which makes the checksum nearly
free; :func:`checksum` is the same figure for one array.
"""
from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

try:  # xxh3 is ~10x faster than zlib.crc32 (bench/snapshot.py); crc32 keeps mindft working without it
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

log = logging.getLogger(__name__)

# 512 KiB chunks fit in L2, so hashing a chunk right after copying it reads from cache.
_CHUNK = 512 * 1024
ALIGN = 64  # each array of a slot file starts on a cache line


class Crc32:
    """zlib.crc32 behind the streaming interface of xxhash's hashers."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


HASHERS: Dict[str, Any] = {"crc32": Crc32}
if xxhash is not None:
    HASHERS["xxh3_64"] = xxhash.xxh3_64
CHECKSUM = "xxh3_64" if xxhash is not None else "crc32"


def checksum(array: np.ndarray, algorithm: str = CHECKSUM) -> int:
    """The checksum mindft records for ``array``'s bytes (C order)."""
    return fill(np.ascontiguousarray(array), None, HASHERS[algorithm])


def flat_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous ``array`` as a flat uint8 view (no copy)."""
    return array.reshape(-1).view(np.uint8)


def fill(dst: np.ndarray, src: Optional[np.ndarray], hasher: Any) -> int:
    """Copy ``src`` into ``dst`` (when given) and return the checksum of what ``dst`` now holds."""
    state = hasher()
    if src is not None and not (src.flags.c_contiguous and dst.flags.c_contiguous):
        np.copyto(dst, src, casting="no")  # rare: chunking needs flat views of both
        dst, src = (dst if dst.flags.c_contiguous else src), None
    out = flat_bytes(dst)
    inp = flat_bytes(src) if src is not None else None
    for start in range(0, out.size, _CHUNK):
        chunk = out[start:start + _CHUNK]
        if inp is not None:
            np.copyto(chunk, inp[start:start + _CHUNK])
        state.update(chunk)
    return state.intdigest()


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """The bytes an array of this dtype and shape takes."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class SlotManifest:
    """A slot file's manifest (``slot<i>.json`` beside ``slot<i>.bin``, written by
    :meth:`Slot.record` once the snapshot is complete), as read once."""

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


class Slot:
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
            offset += -(-nbytes(dtype, shape) // ALIGN) * ALIGN
        if layout == self._layout and self.buffers:
            return
        size = max(offset, ALIGN)
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
        self.buffers = {name: memory[start:start + nbytes(dtype, shape)]
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
        self.complete = self.algorithm in HASHERS
        return self.complete
