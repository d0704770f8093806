"""Files that appear whole or not at all, and MindSpore's ``.ckpt`` format written without MindSpore.

:func:`atomic_write` is the one way mindft writes a file another process may read: a hidden
temporary file, fsync, rename, fsync of the directory, so a write cut short leaves only the
temporary file. :func:`write_ckpt` streams arrays as MindSpore's ``Checkpoint`` protobuf, so a
job that cannot recover still leaves a checkpoint ``mindspore.load_checkpoint`` reads.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

import numpy as np

from mindft.snapshot.slots import flat_bytes

# MindSpore slices parameters larger than 512 MiB into several records with the same tag.
CKPT_SLICE = 512 * 1024 * 1024

_CKPT_TYPES = {
    np.dtype(np.bool_): "Bool", np.dtype(np.int8): "Int8", np.dtype(np.uint8): "UInt8",
    np.dtype(np.int16): "Int16", np.dtype(np.uint16): "UInt16", np.dtype(np.int32): "Int32",
    np.dtype(np.uint32): "UInt32", np.dtype(np.int64): "Int64", np.dtype(np.uint64): "UInt64",
    np.dtype(np.float16): "Float16", np.dtype(np.float32): "Float32", np.dtype(np.float64): "Float64",
}


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


def write_ckpt(handle: BinaryIO, arrays: Mapping[str, np.ndarray]) -> None:
    """Stream ``arrays`` as MindSpore's ``Checkpoint`` protobuf (mindspore/train/checkpoint.proto).

    Checkpoint{repeated Value value = 1}; Value{string tag = 1; TensorProto tensor = 2};
    TensorProto{repeated int64 dims = 1; string tensor_type = 2; bytes tensor_content = 3}.
    Each record is a serialized one-value Checkpoint; concatenated, they parse as
    one message. Tensor bytes go from the buffer to the file without a copy. A dtype
    MindSpore has no type for is a :class:`ValueError`.
    """
    for name, array in arrays.items():
        tensor_type = _CKPT_TYPES.get(array.dtype.newbyteorder("="))
        if tensor_type is None or not array.dtype.isnative:
            raise ValueError(f"array {name!r}: dtype {array.dtype} has no MindSpore checkpoint type")
        data = flat_bytes(np.ascontiguousarray(array))
        # Proto2 repeated scalars are not packed: one (field 1, varint) pair per dimension.
        head = b"".join(b"\x08" + _varint(dim) for dim in array.shape) + _field(2, tensor_type.encode())
        for start in range(0, max(data.size, 1), CKPT_SLICE):
            content = data[start:start + CKPT_SLICE]
            tensor_head = head + _varint(3 << 3 | 2) + _varint(content.size)
            tensor_size = len(tensor_head) + content.size
            value_head = _field(1, name.encode()) + _varint(2 << 3 | 2) + _varint(tensor_size)
            handle.write(_varint(1 << 3 | 2) + _varint(len(value_head) + tensor_size) + value_head + tensor_head)
            handle.write(memoryview(content))


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
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
