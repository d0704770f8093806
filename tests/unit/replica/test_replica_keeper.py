"""A keeper's replicas with real ZeroMQ on 127.0.0.1: pushes made by hand (the old replica kept until
a new one is complete), the spill to disk and back, a rank's store streamed to the keeper and
its step reported only once its replica arrived, data-parallel replicas that point into the
keeper's own ranks' snapshot. Senders, refusals and the CPU a push takes: test_replication.py.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from replication_helpers import state, until

from mindft.config import Timeouts
from mindft.protocol import StatusRequest
from mindft.replica import Keeper, Sender, fetch_replica, replica_spill
from mindft.snapshot.store import SnapshotError, SnapshotStore

from harness import free_port


def _raw(endpoint: str, keys, frames: list, answer: bool = True):
    import json

    import zmq

    from mindft.net.keys import secure_client

    with zmq.Context() as context, context.socket(zmq.DEALER) as sock:
        sock.linger = 1000
        secure_client(sock, keys)
        sock.connect(endpoint)
        for message in frames:
            sock.send_multipart(message)
        if not answer:
            return None
        while True:  # the answer to the last request; a begin's ("have": send everything) comes first
            assert sock.poll(10_000), "no answer"
            reply = sock.recv_multipart()
            if reply[0] != b"have":
                return reply
            assert json.loads(reply[1])["arrays"] == []


def header(step: int, x: np.ndarray) -> bytes:
    """A hand-made push's begin header: rank 7's one array ``x`` (int64) as the snapshot of ``step``."""
    from mindft.replica import ReplicaHeader
    from mindft.snapshot.slots import checksum

    return ReplicaHeader(7, step, (("x", x.dtype.str, x.shape, checksum(x)),), {"step": step}).encode()


def part(step: int, x: np.ndarray, offset: int, count: int) -> list:
    where = json.dumps({"owner_rank": 7, "step": step, "array": 0, "offset": offset * 8}).encode()
    return [b"part", where, x[offset:offset + count].tobytes()]


def end(step: int) -> list:
    return [b"end", json.dumps({"owner_rank": 7, "step": step}).encode()]


def test_the_keeper_keeps_the_old_replica_until_a_new_one_is_complete(tmp_path: Path, keys, parts) -> None:
    """A push cut short, or sealed with bytes missing, never costs the replica held."""
    keeper = Keeper(None, "127.0.0.1", keys)
    parts.append(keeper)
    x1, x2 = np.arange(10, dtype=np.int64), np.arange(10, 20, dtype=np.int64)
    assert _raw(keeper.endpoint, keys, [[b"begin", header(1, x1)], part(1, x1, 0, 6), part(1, x1, 6, 4), end(1)])[0] == b"ok"
    assert keeper.held == {7: 1} and keeper.nbytes == x1.nbytes
    _raw(keeper.endpoint, keys, [[b"begin", header(2, x2)], part(2, x2, 0, 6)], answer=False)  # the sender died
    assert fetch_replica(keeper.endpoint, 7, keys, 5.0).arrays["x"].tolist() == x1.tolist()
    refused = _raw(keeper.endpoint, keys, [[b"begin", header(2, x2)], part(2, x2, 0, 6), end(2)])
    assert refused[0] == b"error" and b"incomplete: 48 of 80 bytes" in refused[1]
    assert fetch_replica(keeper.endpoint, 7, keys, 5.0).step == 1
    beyond = [b"part", json.dumps({"owner_rank": 7, "step": 2, "array": 0, "offset": 72}).encode(), bytes(16)]
    outside = _raw(keeper.endpoint, keys, [[b"begin", header(2, x2)], beyond])
    assert outside[0] == b"error" and b"outside 'x'" in outside[1]
    assert _raw(keeper.endpoint, keys, [[b"begin", header(2, x2)], part(2, x2, 0, 10), end(2)])[0] == b"ok"
    assert fetch_replica(keeper.endpoint, 7, keys, 5.0).arrays["x"].tolist() == x2.tolist()
    assert keeper.nbytes == x2.nbytes  # the old replica was freed


@pytest.mark.parametrize("in_shared_memory", [True, False], ids=["node agent", "rank"])
def test_a_keeper_with_a_spill_directory_holds_one_replica_in_memory_while_the_next_arrives(
        tmp_path: Path, keys, parts, in_shared_memory: bool) -> None:
    """The double buffer plus one replica: the held replica goes to disk when the next begins and
    is still what a fetch returns (verified) until the next one is complete."""
    home = tmp_path / "shm" if in_shared_memory else None
    spill = replica_spill(tmp_path / "disk", "node1")
    spill.mkdir(parents=True)
    (spill / "rank3.bin").write_bytes(b"left by a keeper that was killed")
    keeper = Keeper(home, "127.0.0.1", keys, spill=spill)
    parts.append(keeper)
    x1, x2 = np.arange(4096, dtype=np.int64), np.arange(8192, dtype=np.int64) * 3
    assert _raw(keeper.endpoint, keys, [[b"begin", header(1, x1)], part(1, x1, 0, 4096), end(1)])[0] == b"ok"
    assert keeper.nbytes == x1.nbytes and list(spill.iterdir()) == []  # stale files gone, nothing spilled yet
    _raw(keeper.endpoint, keys, [[b"begin", header(2, x2)], part(2, x2, 0, 1000)], answer=False)  # cut short
    until(lambda: (spill / "rank7.bin").exists() and keeper.nbytes == x2.nbytes, "the old replica on disk")
    assert (spill / "rank7.bin").read_bytes() == x1.tobytes()
    if home is not None:
        assert [p.name for p in (home / "rank7").iterdir()] == ["slot1.bin"]  # the arriving one only
    replica = fetch_replica(keeper.endpoint, 7, keys, 5.0)  # read back from disk, checksum verified
    assert replica.step == 1 and replica.arrays["x"].tolist() == x1.tolist() and keeper.held == {7: 1}
    assert _raw(keeper.endpoint, keys, [[b"begin", header(2, x2)], part(2, x2, 0, 8192), end(2)])[0] == b"ok"
    assert list(spill.iterdir()) == [] and keeper.nbytes == x2.nbytes
    assert fetch_replica(keeper.endpoint, 7, keys, 5.0).arrays["x"].tolist() == x2.tolist()
    _raw(keeper.endpoint, keys, [[b"begin", header(3, x1)], part(3, x1, 0, 10)], answer=False)
    until(lambda: (spill / "rank7.bin").exists(), "step 2's replica on disk")
    keeper.close()
    assert not (tmp_path / "disk" / "replica-spill").exists()  # nobody's once its keeper is gone


@pytest.mark.parametrize("in_shared_memory", [True, False], ids=["node agent", "rank"])
def test_a_replica_of_the_same_arrays_arrives_into_the_memory_its_predecessor_moved_to_disk(
        tmp_path: Path, keys, parts, monkeypatch: pytest.MonkeyPatch, in_shared_memory: bool) -> None:
    """The write to disk and the transfer overlap: the parts take the old replica's memory only
    behind the spill (pieces of 512 bytes here, each synced, so the parts catch up with it), and a
    push cut short still leaves the old replica whole: what is on disk, then what is in memory."""
    monkeypatch.setattr("mindft.replica.spill.SPILL_PIECE", 512)
    home = tmp_path / "shm" if in_shared_memory else None
    spill = replica_spill(tmp_path / "disk", "node1")
    keeper = Keeper(home, "127.0.0.1", keys, spill=spill)
    parts.append(keeper)
    x1, x2, x3 = (np.arange(4096, dtype=np.int64) * k for k in (1, 5, 7))
    assert _raw(keeper.endpoint, keys, [[b"begin", header(1, x1)], part(1, x1, 0, 4096), end(1)])[0] == b"ok"
    cut_short = [[b"begin", header(2, x2)], *(part(2, x2, at, 256) for at in range(0, 3072, 256))]
    _raw(keeper.endpoint, keys, cut_short, answer=False)
    replica = fetch_replica(keeper.endpoint, 7, keys, 5.0)  # checksum verified: no byte overwritten too early
    assert replica.step == 1 and replica.arrays["x"].tolist() == x1.tolist()
    assert keeper.nbytes == x1.nbytes and (spill / "rank7.bin").exists()  # one replica in memory throughout
    if home is not None:
        assert [p.name for p in (home / "rank7").iterdir()] == ["slot0.bin"]
    until(lambda: keeper.spilled == 1, "the old replica wholly on disk")
    assert (spill / "rank7.bin").read_bytes() == x1.tobytes()
    assert _raw(keeper.endpoint, keys, [[b"begin", header(3, x3)], part(3, x3, 0, 4096), end(3)])[0] == b"ok"
    assert fetch_replica(keeper.endpoint, 7, keys, 5.0).arrays["x"].tolist() == x3.tolist()
    assert list(spill.iterdir()) == [] and keeper.nbytes == x3.nbytes
    if home is not None:
        assert sorted(p.name for p in (home / "rank7").iterdir()) == ["slot0.bin", "slot0.json"]
    _raw(keeper.endpoint, keys, [[b"begin", header(4, x1)]], answer=False)
    until(lambda: (spill / "rank7.bin").exists(), "a write under way")  # close() waits for it to stop


def test_a_keeper_that_cannot_write_to_disk_keeps_the_replica_in_memory(
        tmp_path: Path, keys, parts, caplog: pytest.LogCaptureFixture) -> None:
    """A failed spill costs memory, never the replica: the push that would overwrite it is
    refused, and from then on the next replica arrives beside the held one."""
    caplog.set_level("WARNING", logger="mindft.replica")
    spill = replica_spill(tmp_path / "disk", "node1")
    keeper = Keeper(None, "127.0.0.1", keys, spill=spill)
    parts.append(keeper)
    x1, x2 = np.arange(4096, dtype=np.int64), np.arange(4096, dtype=np.int64) * 3
    assert _raw(keeper.endpoint, keys, [[b"begin", header(1, x1)], part(1, x1, 0, 4096), end(1)])[0] == b"ok"
    (spill / "rank7.bin").mkdir()  # where the spill file goes: it cannot be opened for writing
    refused = _raw(keeper.endpoint, keys, [[b"begin", header(2, x2)], part(2, x2, 0, 4096)])
    assert refused[0] == b"error" and b"cannot move rank 7's replica to disk" in refused[1]
    assert "from now on a replica stays in memory while the next arrives" in caplog.text
    assert fetch_replica(keeper.endpoint, 7, keys, 5.0).arrays["x"].tolist() == x1.tolist()
    assert _raw(keeper.endpoint, keys, [[b"begin", header(2, x2)], part(2, x2, 0, 4096), end(2)])[0] == b"ok"
    assert fetch_replica(keeper.endpoint, 7, keys, 5.0).arrays["x"].tolist() == x2.tolist()
    assert keeper.nbytes == x2.nbytes and keeper.spilled == 0
    (spill / "rank7.bin").rmdir()


def test_a_keeper_removes_the_directories_it_made_for_its_spill_and_no_other(tmp_path: Path, keys) -> None:
    """MINDFT_DUMP_DIR need not exist: the keeper makes it for its spill and, when nothing else
    went there, removes it at close (a job leaves no empty mindft_dump/ behind); a directory
    that was there before stays."""
    made, there = tmp_path / "made" / "dump", tmp_path / "there"
    there.mkdir()
    for dump in (made, there):
        keeper = Keeper(None, "127.0.0.1", keys, spill=replica_spill(dump, "node1"))
        assert (dump / "replica-spill" / "node1").is_dir()
        keeper.close()
    assert not (tmp_path / "made").exists() and there.is_dir() and not any(there.iterdir())


def test_a_keeper_says_when_its_spill_directory_is_memory(keys, parts, caplog: pytest.LogCaptureFixture) -> None:
    from mindft.replica import in_memory_filesystem

    assert in_memory_filesystem(Path("/dev/shm/mindft-test/not/created"))  # tmpfs, as mindft-launch needs
    assert not in_memory_filesystem(Path("/proc/self"))  # proc: not memory to save
    caplog.set_level("WARNING", logger="mindft.replica")
    parts.append(Keeper(None, "127.0.0.1", keys, spill=Path("/dev/shm/mindft-test-spill")))
    assert "/dev/shm/mindft-test-spill is in memory (tmpfs)" in caplog.text and "MINDFT_DUMP_DIR" in caplog.text


def test_a_rank_streams_its_store_to_the_keeper_and_reports_a_step_only_once_its_replica_arrived(
        keys, parts) -> None:
    from mindft.replica import RankReplication

    keeper = Keeper(None, "127.0.0.1", keys)
    parts.append(keeper)
    store = SnapshotStore()
    parts.append(store)
    released = threading.Event()
    found = threading.Event()
    replication = RankReplication(3, store, keys, lambda: keeper.endpoint if found.is_set() else None, None,
                                  released.set, lost_after=60.0)
    parts.append(replication)
    seq = store.capture(4, state(4), {"step": 4})
    replication.captured(seq, 4)
    store.wait()
    assert replication.reportable(4) == 3 and replication.reportable(2) == 2  # step 4 waits for its replica
    found.set()
    until(released.is_set, "the confirmation of step 4")
    assert replication.reportable(5) == 5 and keeper.held == {3: 4}
    replica = fetch_replica(keeper.endpoint, 3, keys, 5.0)  # verified against the capture's own checksums
    assert replica.step == 4 and replica.arrays["w"].tobytes() == state(4)["w"].tobytes()
    released.clear()
    replication.restored(4)  # a rollback: the replica must hold the restored step again
    assert replication.reportable(6) == 3
    until(released.is_set, "the replica of the restored step")
    assert replication.reportable(6) == 6 and replication.sender.pushes == 2


def test_a_slot_overwritten_while_it_is_streamed_is_never_sealed(tmp_path: Path, keys, parts) -> None:
    """Zero-copy parts wait in the pipe to a keeper that is not there yet while the capture after
    next overwrites their slot: the push is dropped before its end, the newest snapshot goes."""
    from mindft.replica import RankReplication

    port = free_port()
    store = SnapshotStore()
    parts.append(store)
    replication = RankReplication(0, store, keys, lambda: f"tcp://127.0.0.1:{port}", None, lambda: None,
                                  lost_after=60.0)
    parts.append(replication)
    seq = store.capture(1, state(1), {"step": 1})
    replication.captured(seq, 1)
    store.wait()
    until(lambda: replication.sender.in_flight == (0, 1), "the push of step 1 in flight")
    for step in (2, 3):  # step 3 overwrites step 1's slot while ZeroMQ still holds its parts
        replication.captured(store.capture(step, state(step), {"step": step}), step)
        store.wait()
    keeper = Keeper(None, "127.0.0.1", keys, port=port)
    parts.append(keeper)
    until(lambda: replication.sender.replicated == {0: 3}, "the replica of step 3")
    assert replication.sender.skipped >= 1 and keeper.held == {0: 3}
    replica = fetch_replica(keeper.endpoint, 0, keys, 5.0)
    assert replica.arrays["w"].tobytes() == state(3)["w"].tobytes()


def test_a_step_report_waits_for_the_replica_and_the_status_shows_it(keys, parts, tmp_path: Path) -> None:
    """A real controller and processor: the report of a captured step goes out only once the
    buddy's keeper confirmed its replica; meanwhile the controller sees the step before it."""
    import dataclasses

    from mindft.net.channel import request
    from mindft.config import MindftConfig
    from mindft.controller import Controller
    from mindft.net.keys import generate_keys
    from mindft.rank.processor import Processor
    from mindft.replica import RankReplication

    key_file = tmp_path / "job.key"
    keys = generate_keys(key_file)
    timeouts = Timeouts(heartbeat_interval=0.05, heartbeat_misses=1000, register=30.0)
    config = MindftConfig(world_size=1, controller_port=0, key_file=key_file, timeouts=timeouts)
    controller = Controller(config)
    config = dataclasses.replace(config, controller_port=int(controller.endpoint.rsplit(":", 1)[1]))
    controller.start()
    try:
        keeper = Keeper(None, "127.0.0.1", keys)
        parts.append(keeper)
        store = SnapshotStore()
        parts.append(store)
        processor = Processor(config, "tcp://127.0.0.1:1", keys=keys)
        parts.append(processor)
        processor.register((0,))
        found = threading.Event()
        replication = RankReplication(0, store, keys, lambda: keeper.endpoint if found.is_set() else None,
                                      processor.report_replica, processor.release_reports, lost_after=60.0)
        processor.report_limit = replication.reportable
        parts.append(replication)

        def status():
            return request(config.controller_address, keys, StatusRequest(), 5.0)

        for step in (1, 2):
            replication.captured(store.capture(step, state(step), {"step": step}), step)
            store.wait()
            processor.finished(step)
        until(lambda: status().ranks[0].step == 0 and replication.sender.local == {0: 2}, "step 2 noticed")
        assert status().ranks[0].replicated == -1  # the rank said so (a ReplicaReport)
        found.set()  # the buddy's keeper is known: the replica goes, then the report
        until(lambda: status().ranks[0].step == 2, "the report of step 2")
        until(lambda: status().ranks[0].replicated == 2, "the replicated step in the status")
        assert keeper.held == {0: 2}
    finally:
        controller.stop()


# ---- data-parallel ranks: a replica points into the keeper's own ranks' snapshot of its step ----

def dp_state(rank: int, step: int) -> dict[str, np.ndarray]:
    """Weights every data-parallel rank has (state(step)), and a position only this rank has."""
    return {**state(step), "position": np.array([rank, step * 64], dtype=np.int64)}


def test_a_data_parallel_replica_receives_only_what_differs_and_comes_back_whole(tmp_path: Path, keys,
                                                                                 parts) -> None:
    from mindft.replica import slot_files

    keeper = Keeper(tmp_path / "node1" / "replicas", "127.0.0.1", keys, local=slot_files([tmp_path / "node1" / "rank1"]))
    parts.append(keeper)
    own, theirs = SnapshotStore(home=tmp_path / "node0" / "rank0"), SnapshotStore(home=tmp_path / "node1" / "rank1")
    parts += [own, theirs]
    sender = Sender({0: tmp_path / "node0" / "rank0"}, keys, lambda: keeper.endpoint)
    parts.append(sender)
    weights = sum(a.nbytes for a in state(1).values())
    theirs.capture(1, dp_state(1, 1))
    theirs.wait()
    own.capture(1, dp_state(0, 1), {"step": 1})
    own.wait()
    until(lambda: sender.replicated == {0: 1}, "the replica of step 1")
    assert keeper.nbytes == dp_state(0, 1)["position"].nbytes  # the weights were not sent
    assert (keeper.received_bytes, keeper.shared_bytes) == (16, weights) and sender.shared_arrays == 3
    replica = fetch_replica(keeper.endpoint, 0, keys, 5.0)  # verified against rank 0's own checksums
    assert replica.step == 1 and replica.meta == {"step": 1} and list(replica.arrays) == list(dp_state(0, 1))
    for name, array in dp_state(0, 1).items():
        assert replica.arrays[name].tobytes() == array.tobytes() and replica.arrays[name].shape == array.shape
    # Weights that differ (a rank that is not data-parallel, or another step) are sent whole.
    theirs.capture(2, dp_state(1, 7))
    theirs.wait()
    own.capture(2, dp_state(0, 2))
    own.wait()
    until(lambda: sender.replicated == {0: 2}, "the replica of step 2")
    assert keeper.nbytes == sum(a.nbytes for a in dp_state(0, 2).values())
    assert fetch_replica(keeper.endpoint, 0, keys, 5.0).arrays["w"].tobytes() == state(2)["w"].tobytes()


def test_a_shared_replica_is_refused_once_the_snapshot_it_points_into_is_overwritten(tmp_path: Path, keys,
                                                                                     parts) -> None:
    """Rank 1 captures twice more: its snapshot of step 1 is gone, and with it a rollback to step 1."""
    from mindft.replica import slot_files

    keeper = Keeper(None, "127.0.0.1", keys, local=slot_files([tmp_path / "rank1"]))
    parts.append(keeper)
    own, theirs = SnapshotStore(home=tmp_path / "rank0"), SnapshotStore(home=tmp_path / "rank1")
    parts += [own, theirs]
    sender = Sender({0: tmp_path / "rank0"}, keys, lambda: keeper.endpoint)
    parts.append(sender)
    for store, rank in ((theirs, 1), (own, 0)):
        store.capture(1, dp_state(rank, 1))
        store.wait()
    until(lambda: keeper.held == {0: 1}, "the replica of step 1")
    assert keeper.shared_bytes > 0
    for step in (2, 3):
        theirs.capture(step, dp_state(1, step))
        theirs.wait()
    with pytest.raises(SnapshotError, match="shares 'w' with this node's snapshot of that step, which is no longer"):
        fetch_replica(keeper.endpoint, 0, keys, 5.0)


def test_a_begin_waits_for_the_keepers_own_capture_of_its_step(tmp_path: Path, keys, parts) -> None:
    """Rank 0's snapshot completes first: the keeper answers its begin once rank 1's is there."""
    from mindft.replica import RankReplication, store_slots

    theirs = SnapshotStore()
    parts.append(theirs)
    keeper = Keeper(None, "127.0.0.1", keys, local=store_slots(theirs))
    parts.append(keeper)
    own = SnapshotStore()
    parts.append(own)
    replication = RankReplication(0, own, keys, lambda: keeper.endpoint, None, lambda: None, lost_after=60.0)
    parts.append(replication)
    replication.captured(own.capture(5, dp_state(0, 5)), 5)
    own.wait()
    until(lambda: replication.sender.in_flight == (0, 5), "the push of step 5 to begin")
    time.sleep(0.3)  # the begin is waiting, not refused or sent whole
    assert keeper.held == {} and keeper.received_bytes == 0
    theirs.capture(5, dp_state(1, 5))
    theirs.wait()
    until(lambda: keeper.held == {0: 5}, "the replica of step 5")
    assert keeper.nbytes == 16 and keeper.shared_bytes == sum(a.nbytes for a in state(5).values())
    assert fetch_replica(keeper.endpoint, 0, keys, 5.0).arrays["position"].tolist() == [0, 320]


def test_a_fetch_of_one_of_the_nodes_own_ranks_serves_a_copy_of_its_newest_snapshot(tmp_path: Path, keys,
                                                                                    parts) -> None:
    """A node an elastic job grows by starts from a data-parallel peer's state: the peer's keeper
    serves a copy of its own rank's newest snapshot, meta included, checked as any replica."""
    own = tmp_path / "node0" / "rank0"
    keeper = Keeper(tmp_path / "node0" / "replicas", "127.0.0.1", keys,
                    own=lambda rank: own if rank == 0 else None)
    store = SnapshotStore(home=own)
    parts += [keeper, store]
    with pytest.raises(SnapshotError, match="rank 0 of this node holds no complete snapshot"):
        fetch_replica(keeper.endpoint, 0, keys, 5.0)
    for step in (3, 4):
        store.capture(step, state(step), {"step": step, "rng_state": [step]})
        store.wait()
    copy = fetch_replica(keeper.endpoint, 0, keys, 5.0)
    assert copy.step == 4 and copy.meta == {"step": 4, "rng_state": [4]}
    for name, array in state(4).items():
        assert copy.arrays[name].tobytes() == array.tobytes()
    with pytest.raises(SnapshotError, match="no replica of rank 5 held here"):
        fetch_replica(keeper.endpoint, 5, keys, 5.0)  # neither its own nor held
