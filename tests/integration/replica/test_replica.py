"""A rank's replica kept by another process (its buddy's Keeper) on 127.0.0.1: CurveZMQ, checksums, versions."""
from __future__ import annotations

import json
import selectors
import subprocess
import sys

import numpy as np
import pytest
import zmq

from mindft.net.keys import CurveKeys, generate_keys, secure_client
from mindft.replica.wire import REPLICA_VERSION, ReplicaHeader, fetch_replica, push_replica
from mindft.snapshot.slots import checksum
from mindft.snapshot.store import Snapshot, SnapshotError, SnapshotStore

pytestmark = pytest.mark.slow

TIMEOUT = 10.0
REFUSED_TIMEOUT = 1.0  # how long a client waits before concluding the server ignored it

_SERVER = """
import sys
from pathlib import Path
from mindft.net.keys import load_keys
from mindft.replica import Keeper
server = Keeper(None, "127.0.0.1", load_keys(Path(sys.argv[1])))
print(server.endpoint, flush=True)
sys.stdin.read()  # serve until the test closes our stdin
server.close()
"""


@pytest.fixture
def keys(tmp_path) -> CurveKeys:
    return generate_keys(tmp_path / "job.key")


@pytest.fixture
def buddy(tmp_path, keys):
    """A replica keeper in its own process (the buddy rank's); yields its endpoint."""
    process = subprocess.Popen([sys.executable, "-c", _SERVER, str(tmp_path / "job.key")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            assert selector.select(30), "replica server did not start"
        endpoint = process.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        yield endpoint
        process.stdin.close()
        assert process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def training_state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "dense.weight": rng.standard_normal((512, 1024)).astype(np.float32),
        "adam.m.dense.weight": rng.standard_normal((512, 1024)).astype(np.float32),
        "layer_norm.gamma": rng.standard_normal(1024).astype(np.float16),
        "global_step": np.array(step, np.int64),
    }


def captured(step: int) -> Snapshot:
    store = SnapshotStore()
    store.capture(step, training_state(step), {"epoch": 2, "batch": step})
    store.wait()
    return store.restore()


def raw_request(endpoint: str, keys: CurveKeys, frames: list) -> list:
    """Talk to the server without mindft's client, to send what it never would."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.linger = 0
        secure_client(socket, keys)
        socket.connect(endpoint)
        socket.send_multipart(frames)
        assert socket.poll(TIMEOUT * 1000), "no answer"
        return socket.recv_multipart()


def test_round_trip_restores_a_restarted_rank_bytewise(buddy, keys):
    snapshot = captured(7)
    push_replica(buddy, 3, snapshot, keys, TIMEOUT)
    fetched = fetch_replica(buddy, 3, keys, TIMEOUT, min_step=7)
    assert fetched.step == 7 and fetched.meta == {"epoch": 2, "batch": 7}
    assert fetched.checksums == snapshot.checksums
    restarted = SnapshotStore()  # the rank came back empty and adopts its replica
    restarted.adopt(fetched)
    assert restarted.steps == (7,)
    restored = restarted.restore()
    for name, array in training_state(7).items():
        assert restored.arrays[name].dtype == array.dtype and restored.arrays[name].tobytes() == array.tobytes()
        assert restored.arrays[name].shape == array.shape  # 0-d stays 0-d (restore(into=) needs it)
    push_replica(buddy, 3, captured(8), keys, TIMEOUT)  # the latest push replaces the one held
    assert fetch_replica(buddy, 3, keys, TIMEOUT).step == 8
    restarted.close()


def test_wrong_key_client_is_refused(buddy, keys, tmp_path):
    push_replica(buddy, 0, captured(1), keys, TIMEOUT)
    intruder = generate_keys(tmp_path / "other.key")
    with pytest.raises(SnapshotError, match="no answer"):
        push_replica(buddy, 0, captured(99), intruder, REFUSED_TIMEOUT)
    # Knowing the server's public key is not enough: ZAP admits only the job's client key.
    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.linger = 0
        socket.curve_serverkey = keys.public
        socket.curve_publickey, socket.curve_secretkey = intruder.public, intruder.secret
        socket.connect(buddy)
        socket.send_multipart([b"fetch", json.dumps({"owner_rank": 0}).encode()])
        assert not socket.poll(REFUSED_TIMEOUT * 1000)
    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.linger = 0
        socket.connect(buddy)  # no CURVE at all
        socket.send_multipart([b"fetch", json.dumps({"owner_rank": 0}).encode()])
        assert not socket.poll(REFUSED_TIMEOUT * 1000)
    assert fetch_replica(buddy, 0, keys, TIMEOUT).step == 1  # the intruder's push never landed


def test_corrupt_replica_is_refused(buddy, keys):
    good = captured(4)
    corrupt = Snapshot(4, good.arrays, good.meta, {**good.checksums, "dense.weight": good.checksums["dense.weight"] ^ 1})
    push_replica(buddy, 1, corrupt, keys, TIMEOUT)
    with pytest.raises(SnapshotError, match="corrupt replica of rank 1, step 4: checksum mismatch in dense.weight"):
        fetch_replica(buddy, 1, keys, TIMEOUT)


def test_stale_replica_is_refused(buddy, keys):
    push_replica(buddy, 2, captured(5), keys, TIMEOUT)
    with pytest.raises(SnapshotError, match="stale replica of rank 2: step 5, need >= 6"):
        fetch_replica(buddy, 2, keys, TIMEOUT, min_step=6)
    with pytest.raises(SnapshotError, match="no replica of rank 9 held here"):
        fetch_replica(buddy, 9, keys, TIMEOUT)


def test_malformed_pushes_are_refused(buddy, keys):
    payload = np.arange(4, dtype=np.float32)
    header = ReplicaHeader(0, 1, (("x", payload.dtype.str, (4,), checksum(payload)),))
    future = json.loads(header.encode())
    future["version"] = REPLICA_VERSION + 1
    short = ReplicaHeader(0, 1, (("x", payload.dtype.str, (5,), checksum(payload)),))
    cases = {
        b"garbage replica header": [b"push", b"{not json", payload.tobytes()],
        f"replica format version {REPLICA_VERSION + 1}".encode(): [b"push", json.dumps(future).encode(), payload.tobytes()],
        b"'x' has 16 bytes, expected 20": [b"push", short.encode(), payload.tobytes()],
        b"has 2 array frames": [b"push", header.encode(), payload.tobytes(), b"extra"],
        b"unknown request": [b"load", b"x"],
        b"garbage replica header (": [b"begin", b"[]"],
        b"garbage part header": [b"part", b"{}", payload.tobytes()],
        b"end of rank 0 step 1: no such push arriving": [b"end", json.dumps({"owner_rank": 0, "step": 1}).encode()],
    }
    for reason, frames in cases.items():
        reply = raw_request(buddy, keys, frames)
        assert reply[0] == b"error" and reason in reply[1], (reason, reply)
    with pytest.raises(SnapshotError, match="no replica of rank 0"):
        fetch_replica(buddy, 0, keys, TIMEOUT)
    assert raw_request(buddy, keys, [b"push", header.encode(), payload.tobytes()])[0] == b"ok"
    assert fetch_replica(buddy, 0, keys, TIMEOUT).arrays["x"].tobytes() == payload.tobytes()


def test_server_down_is_an_error_not_a_hang(keys):
    with zmq.Context() as context, context.socket(zmq.ROUTER) as socket:
        port = socket.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(SnapshotError, match="no answer"):
        fetch_replica(f"tcp://127.0.0.1:{port}", 0, keys, REFUSED_TIMEOUT)
