"""The replica wire: how a replica travels between a sender and a :class:`~mindft.replica.keeper.Keeper`.

A replica is a :class:`ReplicaHeader` (one JSON frame: owner rank, step, the arrays' names,
dtypes, shapes and recorded checksums, the meta, the checksum algorithm, the format version)
and one frame per array. A streamed push is ``begin`` (the header) → the keeper's ``have``
(``{"owner_rank", "step", "arrays"}``: the indices not to send), ``part`` messages (a JSON
``{"owner_rank", "step", "array", "offset"}`` and at most :data:`CHUNK` bytes), and ``end`` →
``ok``. :func:`push_replica` sends one in a single ``push`` request and :func:`fetch_replica`
brings one back and verifies it (for the agents restoring a lost node, tools and tests). Errors
answer ``error`` and a reason.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Tuple

import numpy as np
import zmq

from mindft.net import sockets
from mindft.net.keys import CurveKeys
from mindft.snapshot.slots import CHECKSUM, HASHERS, fill, flat_bytes, nbytes
from mindft.snapshot.store import Snapshot, SnapshotError

log = logging.getLogger(__name__)

REPLICA_VERSION = 2  # 2: a streamed push waits for the keeper's answer to begin
CHUNK = 1024 * 1024        # bytes per part message (4 MiB parts took ~35 MB more per sender and keeper, no faster)


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


def check_frames(header: ReplicaHeader, frames: List[Any]) -> None:
    """:class:`SnapshotError` unless ``frames`` are the arrays ``header`` lists, each of its size."""
    if len(frames) != len(header.arrays):
        raise SnapshotError(f"replica of step {header.step} has {len(frames)} array frames, "
                            f"its header lists {len(header.arrays)}")
    for (name, dtype, shape, _), frame in zip(header.arrays, frames):
        size = nbytes(dtype, shape)
        if len(frame) != size:
            raise SnapshotError(f"replica of step {header.step}: {name!r} has {len(frame)} bytes, expected {size}")


def request(endpoint: str, keys: Optional[CurveKeys], timeout: float, frames: List[Any]) -> List[Any]:
    """One request to a keeper on a socket of its own; its reply, or :class:`SnapshotError`."""
    try:
        socket = sockets.keeper_request_dealer(keys, endpoint, timeout)
    except zmq.ZMQError as error:
        raise SnapshotError(f"replica server at {endpoint}: {error}") from error
    try:
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
    """Send ``snapshot`` of ``owner_rank`` to a :class:`~mindft.replica.keeper.Keeper` in one request
    (a socket of its own); returns once it is held. For tools and tests: ranks and node agents
    stream their replicas (:mod:`mindft.replica.sender`)."""
    # ascontiguousarray turns a 0-d array into shape (1,): keep the original shape.
    arrays = {name: np.ascontiguousarray(array).reshape(array.shape)
              for name, array in snapshot.arrays.items()}
    missing = sorted(set(arrays) - set(snapshot.checksums))
    if missing:
        raise SnapshotError(f"snapshot of step {snapshot.step} has no checksum for {missing}")
    header = ReplicaHeader(owner_rank, snapshot.step, tuple(
        (name, array.dtype.str, array.shape, int(snapshot.checksums[name])) for name, array in arrays.items()),
        dict(snapshot.meta), snapshot.algorithm)
    reply = request(endpoint, keys, timeout,
                     [b"push", header.encode(), *(flat_bytes(array) for array in arrays.values())])
    if reply[0].bytes != b"ok":
        raise SnapshotError(f"replica keeper at {endpoint} answered {reply[0].bytes[:32]!r} to a push")


def fetch_replica(endpoint: str, owner_rank: int, keys: Optional[CurveKeys], timeout: float,
                  min_step: Optional[int] = None) -> Snapshot:
    """Fetch ``owner_rank``'s replica from its buddy and verify it.

    :class:`SnapshotError` if none is held, it is older than ``min_step`` (stale),
    belongs to another rank, or fails its checksums (corrupt). The arrays are
    read-only views of the received frames; :meth:`SnapshotStore.adopt` copies them.
    """
    reply = request(endpoint, keys, timeout, [b"fetch", json.dumps({"owner_rank": owner_rank}).encode()])
    if reply[0].bytes != b"replica" or len(reply) < 2:
        raise SnapshotError(f"replica server at {endpoint} answered {reply[0].bytes[:32]!r} to a fetch")
    header = ReplicaHeader.decode(reply[1].bytes)
    frames = reply[2:]
    check_frames(header, frames)
    if header.owner_rank != owner_rank:
        raise SnapshotError(f"asked {endpoint} for rank {owner_rank}'s replica, got rank {header.owner_rank}'s")
    if min_step is not None and header.step < min_step:
        raise SnapshotError(f"stale replica of rank {owner_rank}: step {header.step}, need >= {min_step}")
    if header.algorithm not in HASHERS:
        raise SnapshotError(f"replica checksummed with {header.algorithm!r}; install the package "
                            f"providing it (known: {sorted(HASHERS)})")
    arrays, checksums, bad = {}, {}, []
    for (name, dtype, shape, expected), frame in zip(header.arrays, frames):
        array = np.frombuffer(frame.buffer, dtype=dtype).reshape(shape)
        if fill(array, None, HASHERS[header.algorithm]) != expected:
            bad.append(name)
        arrays[name], checksums[name] = array, expected
    if bad:
        raise SnapshotError(f"corrupt replica of rank {owner_rank}, step {header.step}: "
                            f"checksum mismatch in {', '.join(bad)}")
    log.info("fetched the replica of rank %d, step %d from %s", owner_rank, header.step, endpoint)
    return Snapshot(header.step, arrays, header.meta, checksums, header.algorithm)


def decode_json(frame: Any) -> Any:
    """A request's JSON frame; :class:`SnapshotError` for garbage."""
    try:
        return json.loads(frame.bytes if hasattr(frame, "bytes") else frame)
    except ValueError as error:
        raise SnapshotError(f"garbage request ({error})") from None
