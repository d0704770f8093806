"""The snapshots replication reads: what a sender sends from, and what a keeper's replicas point into.

A sender's source notices a rank's new snapshots and opens one as an :class:`Outgoing` (its
header and its bytes part by part): :class:`FileSource` reads a rank's slot files in its node
agent's shared memory (chunk by chunk, not mapped: a slot resized under the agent gives a short
read, never SIGBUS), :class:`StoreSource` a rank's own :class:`~mindft.snapshot.store.SnapshotStore`,
zero-copy. A keeper lists the complete snapshots on its side (:func:`slot_files`,
:func:`store_slots`) as :class:`LocalSnapshot`: data-parallel ranks hold the same weights after
every step, so a replica points into them for the arrays that match (:func:`read_shared`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from mindft.replica.wire import CHUNK, ReplicaHeader
from mindft.snapshot.slots import manifest_identity, nbytes, read_manifest
from mindft.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalSnapshot:
    """A complete snapshot of a rank on the keeper's side, which a replica may point into."""

    step: int
    algorithm: str
    arrays: Mapping[str, Tuple[str, Tuple[int, ...], int]]  # name → (dtype.str, shape, checksum)
    read: Callable[[str], Optional[bytes]]                  # an array's bytes now; None once overwritten

    def holds(self, step: int, algorithm: str, spec: Tuple[str, str, Tuple[int, ...], int]) -> bool:
        """True if this snapshot is of ``step`` and holds the array ``spec`` (name, dtype, shape, checksum)."""
        name, dtype, shape, value = spec
        return self.step == step and self.algorithm == algorithm and self.arrays.get(name) == (dtype, shape, value)


def slot_files(directories: Sequence[Path]) -> Callable[[], List[LocalSnapshot]]:
    """The complete snapshots in these ranks' slot files (a node agent's own ranks)."""

    def snapshots() -> List[LocalSnapshot]:
        found = []
        for directory in directories:
            for index in (0, 1):
                snapshot = _slot_file(Path(directory), index)
                if snapshot is not None:
                    found.append(snapshot)
        return found

    return snapshots


def _slot_file(directory: Path, index: int) -> Optional[LocalSnapshot]:
    manifest = read_manifest(directory / f"slot{index}.json")
    if manifest is None:
        return None
    where = {name: (nbytes(dtype, shape), start) for name, dtype, shape, start in manifest.layout}

    def read(name: str) -> Optional[bytes]:
        size, start = where[name]
        try:
            with open(manifest.data, "rb") as handle:
                chunk = os.pread(handle.fileno(), size, start)
        except OSError:
            return None
        return chunk if len(chunk) == size and manifest.intact() else None

    return LocalSnapshot(manifest.step, manifest.algorithm, {
        name: (dtype, shape, manifest.checksums[name]) for name, dtype, shape, _ in manifest.layout}, read)


def store_slots(store: SnapshotStore) -> Callable[[], List[LocalSnapshot]]:
    """The complete snapshots of a rank's own store (a rank keeping its buddy's replica)."""

    def snapshots() -> List[LocalSnapshot]:
        found = []
        for view in store.views():
            def read(name: str, view: Any = view) -> Optional[bytes]:
                data = view.arrays[name].tobytes()
                return data if store.intact(view.seq) else None

            found.append(LocalSnapshot(view.step, view.algorithm, {
                name: (array.dtype.str, tuple(array.shape), int(view.checksums[name]))
                for name, array in view.arrays.items()}, read))
        return found

    return snapshots


def own_copy(directory: Path, owner: int) -> Optional[Tuple[ReplicaHeader, List[bytes]]]:
    """The newest complete snapshot in a rank's slot files (this node's own rank ``owner``), as a
    fetched replica carries it; None when there is none that stays intact while it is read."""
    for manifest in sorted(filter(None, (read_manifest(directory / f"slot{i}.json") for i in (0, 1))),
                           key=lambda m: m.step, reverse=True):
        try:
            with open(manifest.data, "rb") as handle:
                frames = [os.pread(handle.fileno(), nbytes(dtype, shape), start)
                          for _, dtype, shape, start in manifest.layout]
        except OSError:
            continue
        if manifest.intact() and all(len(f) == nbytes(d, s) for f, (_, d, s, _) in zip(frames, manifest.layout)):
            arrays = tuple((name, dtype, shape, manifest.checksums[name]) for name, dtype, shape, _ in manifest.layout)
            return ReplicaHeader(owner, manifest.step, arrays, manifest.meta, manifest.algorithm), frames
    return None


def read_shared(local: List[LocalSnapshot], header: ReplicaHeader,
                 spec: Tuple[str, str, Tuple[int, ...], int]) -> Optional[bytes]:
    """A shared array's bytes, from the first local snapshot of the replica's step that still holds them."""
    for snapshot in local:
        if snapshot.holds(header.step, header.algorithm, spec):
            data = snapshot.read(spec[0])
            if data is not None:
                return data
    return None


class Outgoing:
    """One snapshot on its way out: its header, its bytes part by part (``parts(skip)``: all but the
    arrays the keeper has), and whether they still hold."""

    def __init__(self, header: ReplicaHeader, nbytes: int,
                 parts: Callable[[FrozenSet[int]], Iterator[Tuple[int, int, Any]]], intact: Callable[[], bool],
                 zero_copy: bool, close: Callable[[], None] = lambda: None) -> None:
        self.header, self.nbytes, self.parts = header, nbytes, parts
        self.intact, self.zero_copy, self.close = intact, zero_copy, close


class FileSource:
    """A rank's slot files in a node agent's shared memory (the agent's sender)."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.seen: Dict[int, Tuple[int, int, int, bytes]] = {}  # slot → manifest identity

    def notice(self) -> List[Tuple[int, Any]]:
        """(step, slot index) of snapshots completed since the last look, oldest first."""
        fresh = []
        for index in (0, 1):
            identity = manifest_identity(self.home / f"slot{index}.json")
            if identity is None:
                self.seen.pop(index, None)
                continue
            if identity == self.seen.get(index):
                continue
            self.seen[index] = identity
            manifest = read_manifest(self.home / f"slot{index}.json")
            if manifest is not None:
                fresh.append((manifest.step, index))
        # Both slots new since the last look: two captures, the newer one holds the higher step.
        return sorted(fresh)

    def open(self, rank: int, index: Any) -> Optional[Outgoing]:
        """The slot's bytes (read as they are sent) and recorded checksums; None if it is gone."""
        manifest = read_manifest(self.home / f"slot{index}.json")
        if manifest is None:
            return None
        try:
            fd = os.open(manifest.data, os.O_RDONLY)
        except OSError as error:
            log.debug("rank=%d slot %d: no readable snapshot (%s)", rank, index, error)
            return None
        layout = manifest.layout
        header = ReplicaHeader(rank, manifest.step, tuple((name, dtype, shape, manifest.checksums[name])
                                                          for name, dtype, shape, _ in layout),
                               manifest.meta, manifest.algorithm)
        short = []

        def parts(skip: FrozenSet[int]) -> Iterator[Tuple[int, int, Any]]:
            for array, (_, dtype, shape, start) in enumerate(layout):
                if array in skip:
                    continue
                size = nbytes(dtype, shape)
                for offset in range(0, size, CHUNK):
                    wanted = min(CHUNK, size - offset)
                    data = os.pread(fd, wanted, start + offset)
                    if len(data) != wanted:
                        short.append(offset)  # the file shrank: a capture claimed the slot
                        return
                    yield array, offset, data

        def intact() -> bool:
            return not short and manifest.intact()

        descriptor = [fd]

        def close() -> None:
            if descriptor:
                os.close(descriptor.pop())

        return Outgoing(header, sum(nbytes(d, s) for _, d, s, _ in layout), parts, intact, False, close)


class StoreSource:
    """A rank's own :class:`SnapshotStore`: its slot is sent as it is, zero-copy."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.epoch = 0  # a restore starts a new one: a push of the timeline before it proves nothing
        self._seen: Optional[Tuple[int, int]] = None

    def notice(self) -> List[Tuple[int, Any]]:
        view = self.store.view()
        if view is None:
            return []
        token = (view.seq, self.epoch)
        if token == self._seen:
            return []
        self._seen = token
        return [(view.step, token)]

    def open(self, rank: int, token: Any) -> Optional[Outgoing]:
        seq = token[0]
        view = self.store.view()
        if view is None or view.seq != seq:
            return None  # a newer one is in the slot to keep: it is noticed next
        header = ReplicaHeader(rank, view.step, tuple(
            (name, array.dtype.str, array.shape, int(view.checksums[name])) for name, array in view.arrays.items()),
            dict(view.meta), view.algorithm)
        flats = [array.reshape(-1).view(np.uint8) for array in view.arrays.values()]

        def parts(skip: FrozenSet[int]) -> Iterator[Tuple[int, int, Any]]:
            for array, flat in enumerate(flats):
                if array not in skip:
                    for offset in range(0, flat.size, CHUNK):
                        yield array, offset, memoryview(flat[offset:offset + CHUNK])

        return Outgoing(header, sum(f.size for f in flats), parts, lambda: self.store.intact(seq), True)


Source = Union[FileSource, StoreSource]
