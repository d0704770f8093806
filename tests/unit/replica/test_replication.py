"""The node agents' replication (mindft.replica) with real ZeroMQ on 127.0.0.1: a sender pushes the
newest snapshot to the buddy's keeper, the keeper refuses what is corrupt or unkeyed, a dead
keeper blocks nothing, the CPU a push takes, the buddy found through the controller.

The "rank" is a SnapshotStore writing into a directory, as a rank under mindft-launch does;
the sender and the keeper are the agents' parts. Nothing here waits on a clock in an
assert: a test polls for the state it expects, within a generous deadline. What a keeper
holds, spills and receives from a rank's stream: test_replica_keeper.py.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from replication_helpers import capture, state, until

from mindft.net.keys import generate_keys
from mindft.protocol import ReplicaReport, StatusRequest
from mindft.replica import Keeper, NodeReplication, Sender, fetch_replica
from mindft.replica import sender as sender_module
from mindft.snapshot.store import SnapshotError, SnapshotStore
from mindft.observe.threadcpu import ThreadCpu

from harness import free_port


def test_the_newest_snapshot_reaches_the_keeper_and_comes_back_verified(tmp_path: Path, keys, parts) -> None:
    keeper = Keeper(tmp_path / "node1", "127.0.0.1", keys)
    parts.append(keeper)
    store = SnapshotStore(home=tmp_path / "node0" / "rank0")
    parts.append(store)
    sender = Sender({0: tmp_path / "node0" / "rank0"}, keys, lambda: keeper.endpoint)
    parts.append(sender)
    capture(store, 1)
    until(lambda: sender.replicated == {0: 1}, "the replica of step 1")
    assert keeper.held == {0: 1}
    capture(store, 2)
    until(lambda: keeper.held == {0: 2} and sender.replicated == {0: 2}, "the replica of step 2")
    replica = fetch_replica(keeper.endpoint, 0, keys, 5.0)
    assert replica.step == 2 and replica.meta == {"step": 2}
    for name, array in state(2).items():
        assert replica.arrays[name].tobytes() == array.tobytes() and replica.arrays[name].shape == array.shape
    # The keeper's slot is a rank's slot: a SnapshotStore reads it back (and verifies it on restore).
    with SnapshotStore(home=tmp_path / "node1" / "rank0", resume=True) as held:
        assert held.restore().step == 2


def test_newest_wins_one_push_for_many_captures(tmp_path: Path, keys, parts) -> None:
    keeper = Keeper(tmp_path / "node1", "127.0.0.1", keys)
    parts.append(keeper)
    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    found = threading.Event()
    sender = Sender({0: tmp_path / "rank0"}, keys, lambda: keeper.endpoint if found.is_set() else None)
    parts.append(sender)
    for step in range(1, 8):
        capture(store, step)
    until(lambda: sender.local == {0: 7}, "the sender to notice step 7")
    found.set()  # the keeper shows up only now: what waits is the newest snapshot, not a queue
    until(lambda: sender.replicated == {0: 7}, "the keeper's confirmation of step 7")
    assert sender.pushes == 1 and keeper.held == {0: 7}


def test_a_corrupt_replica_is_refused_on_fetch_not_on_receipt(tmp_path: Path, keys, parts) -> None:
    keeper = Keeper(tmp_path / "node1", "127.0.0.1", keys)
    parts.append(keeper)
    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    sender = Sender({0: tmp_path / "rank0"}, keys, lambda: keeper.endpoint)
    parts.append(sender)
    capture(store, 3)
    until(lambda: keeper.held == {0: 3}, "the replica of step 3")
    slot = tmp_path / "node1" / "rank0" / "slot0.bin"
    data = bytearray(slot.read_bytes())
    data[100] ^= 0xFF  # a bit flip in the keeper's memory
    slot.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="corrupt replica of rank 0, step 3: checksum mismatch in w"):
        fetch_replica(keeper.endpoint, 0, keys, 5.0)
    with pytest.raises(SnapshotError, match="no replica of rank 5"):
        fetch_replica(keeper.endpoint, 5, keys, 5.0)


def test_a_dead_keeper_blocks_nothing_and_is_reported_as_lost_protection_until_it_is_back(
        tmp_path: Path, keys, parts, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    reports: list[ReplicaReport] = []
    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    sender = Sender({0: tmp_path / "rank0"}, keys, lambda: endpoint, node=0, report=reports.append,
                    lost_after=0.3, ack_timeout=0.2)
    parts.append(sender)
    caplog.set_level("WARNING", logger="mindft.replica")
    for step in range(1, 4):
        capture(store, step)  # the rank's captures never wait on the keeper
    until(lambda: sender.lost == (0,), "lost protection")
    until(lambda: reports and reports[-1].lost == (0,), "a report of lost protection")
    assert reports[-1].ranks == (0,) and reports[-1].steps == (-1,)
    assert "rank=0 LOST PROTECTION" in caplog.text
    keeper = Keeper(tmp_path / "node1", "127.0.0.1", keys, port=port)
    parts.append(keeper)
    capture(store, 4)
    until(lambda: sender.lost == () and sender.replicated == {0: 4}, "protection restored")
    assert keeper.held == {0: 4}
    until(lambda: reports[-1].steps == (4,) and reports[-1].lost == (), "a report of step 4")
    assert "rank=0 protection restored" in caplog.text
    capture(store, 5)  # the new connection's first push paid its set-up: left out of the figure
    until(lambda: reports[-1].steps == (5,), "a report of step 5")
    # without a CPU meter the cost is the pushes' smoothed duration (see the next test)
    assert 0 < reports[-1].cpu_seconds < 10
    assert keeper.held == {0: 5}


class ScriptedCpu(ThreadCpu):
    """A CPU meter whose readings the test sets: the sender's arithmetic, without /proc's ticks."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = 0.0

    def seconds(self) -> float:
        return self.reading


def test_a_node_reports_the_cpu_its_replication_used_per_push_not_the_pushes_duration(
        tmp_path: Path, keys, parts, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sender_module, "REPORT_INTERVAL", 3600.0)  # only the reports that go out at once
    keeper = Keeper(tmp_path / "node1", "127.0.0.1", keys)
    parts.append(keeper)
    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    reports: list[ReplicaReport] = []
    cpu = ScriptedCpu()
    sender = Sender({0: tmp_path / "rank0"}, keys, lambda: keeper.endpoint, node=0, report=reports.append, cpu=cpu)
    parts.append(sender)
    cpu.reading = 2.0  # used by the replication threads (both ends) until the first push is confirmed
    capture(store, 1)
    until(lambda: sender.replicated == {0: 1}, "the replica of step 1")
    # The first push pays the connection's set-up: cold, left out, no figure yet.
    assert sender.replica_cost is None and all(report.cpu_seconds == 0.0 for report in reports)
    cpu.reading = 3.0
    capture(store, 2)
    # The first warm figure is reported at once (the job's cadence waits for it), not a report interval later.
    until(lambda: reports[-1].steps == (2,), "a report of step 2")
    assert reports[-1].cpu_seconds == sender.replica_cost == 1.0 and sender.push_seconds < 1.0
    cpu.reading = 3.5
    capture(store, 3)
    until(lambda: sender.replicated == {0: 3}, "the replica of step 3")
    assert sender.replica_cost == 0.75  # smoothed: 1.0 + 0.5 * (0.5 - 1.0)


def test_a_new_connections_first_push_is_left_out_of_the_cpu_per_push(tmp_path: Path, keys, parts) -> None:
    first = Keeper(tmp_path / "node1", "127.0.0.1", keys)
    parts.append(first)
    keeper = [first]
    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    cpu = ScriptedCpu()
    sender = Sender({0: tmp_path / "rank0"}, keys, lambda: keeper[0].endpoint, node=0, cpu=cpu, cheap_lookup=True)
    parts.append(sender)
    for step, reading in ((1, 2.0), (2, 3.0)):
        cpu.reading = reading
        capture(store, step)
        until(lambda: sender.replicated == {0: step}, f"the replica of step {step}")
    assert sender.replica_cost == 1.0
    moved = Keeper(tmp_path / "node1b", "127.0.0.1", keys)  # the buddy restarted elsewhere: a new connection
    parts.append(moved)
    keeper[0] = moved
    cpu.reading = 8.0  # its handshake, and what the old connection's end took
    capture(store, 3)
    until(lambda: sender.replicated == {0: 3}, "the replica of step 3 at the moved keeper")
    assert sender.replica_cost == 1.0  # left out: the figure so far stands
    cpu.reading = 8.5
    capture(store, 4)
    until(lambda: sender.replicated == {0: 4}, "the replica of step 4")
    assert sender.replica_cost == 0.75  # smoothed: 1.0 + 0.5 * (0.5 - 1.0)


def test_the_cpu_a_push_takes_is_read_from_the_sender_keeper_and_zeromq_threads(tmp_path: Path, keys,
                                                                               parts) -> None:
    cpu = ThreadCpu()
    keeper = Keeper(tmp_path / "node1", "127.0.0.1", keys, cpu=cpu)
    parts.append(keeper)
    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    sender = Sender({0: tmp_path / "rank0"}, keys, lambda: keeper.endpoint, node=0, cpu=cpu)
    parts.append(sender)
    for step in (1, 2):  # the first push, with the connection's set-up, is left out of the figure
        big = {"w": np.random.default_rng(step).standard_normal(8 * 1024 * 1024).astype(np.float32)}  # 32 MiB
        store.capture(step, big, {"step": step})
        store.wait()
        until(lambda: sender.replicated == {0: step}, f"the replica of step {step}")
    # read, encrypted, decrypted and written: tens of milliseconds of CPU at the least
    assert sender.replica_cost is not None and sender.replica_cost >= 0.02


def test_a_sender_closes_promptly_with_a_push_in_flight_to_a_dead_keeper(tmp_path: Path, keys, parts) -> None:
    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    sender = Sender({0: tmp_path / "rank0"}, keys, lambda: f"tcp://127.0.0.1:{free_port()}")
    capture(store, 1)
    until(lambda: sender.pushes == 1, "a push in flight")
    sender.close()  # joins its threads; a hang here fails the test by timeout
    assert sender.replicated == {0: -1}


def test_a_keeper_refuses_a_sender_without_the_job_key(tmp_path: Path, keys, parts) -> None:
    keeper = Keeper(tmp_path / "node1", "127.0.0.1", keys)
    parts.append(keeper)
    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    stranger = generate_keys(tmp_path / "other.json")
    sender = Sender({0: tmp_path / "rank0"}, stranger, lambda: keeper.endpoint, lost_after=0.2)
    parts.append(sender)
    capture(store, 1)
    until(lambda: sender.lost == (0,), "lost protection")
    assert keeper.held == {}


def test_node_replication_finds_the_buddy_keeper_through_the_controller(tmp_path: Path, keys, parts,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0's agent asks the controller's status where a rank of node 1 registered its keeper."""
    from mindft.protocol import RankStatus, Reply, StatusReply
    node1 = NodeReplication(tmp_path / "n1", [1], 1, 2, 1, "127.0.0.1", "tcp://127.0.0.1:1", keys)
    parts.append(node1)
    asked: list = []

    def fake_request(address, keys_, message, timeout):
        asked.append(type(message).__name__)
        if isinstance(message, StatusRequest):
            return StatusReply("NORMAL", 1, (RankStatus(1, "running", 1, 0.0, 0, 1,
                                                        replica_endpoint=node1.endpoint),))
        return Reply(True)

    monkeypatch.setattr("mindft.net.channel.request", fake_request)
    node0 = NodeReplication(tmp_path / "n0", [0], 1, 2, 0, "127.0.0.1", "tcp://127.0.0.1:1", keys)
    parts.append(node0)
    store = SnapshotStore(home=tmp_path / "n0" / "rank0")
    parts.append(store)
    capture(store, 2)
    until(lambda: node1.keeper.held == {0: 2}, "rank 0's replica on node 1")
    until(lambda: "ReplicaReport" in asked, "a report to the controller")
    assert "holding 1 replica(s) of the previous node ({0: 2}" in node1.summary()
    # An elastic job's resize: the replicas of the old ring go with it, from the node's memory too.
    parts.remove(node1)
    assert node1.discard() > 0 and not (tmp_path / "n1" / "replicas").exists()


def test_under_mindft_launch_with_a_keeper_the_ranks_announce_it_and_push_nothing(tmp_path: Path) -> None:
    from mindft.config import load_config
    from mindft.agent.plan import LaunchSpec, rank_environment

    spec = LaunchSpec(command=("train.py",), nproc=2, nnodes=2, node_rank=1, state_dir=tmp_path,
                      key_file=tmp_path / "keys.json", replica_endpoint="tcp://127.0.0.1:4000")
    config = load_config(rank_environment(spec, 3, 0))
    assert config.replica_buddy == -1 and config.replica_endpoint == "tcp://127.0.0.1:4000"
    pushing = load_config(rank_environment(LaunchSpec(command=("train.py",), nproc=2, nnodes=2, node_rank=1,
                                                      state_dir=tmp_path, key_file=tmp_path / "keys.json"), 3, 0))
    assert pushing.replica_buddy == 1 and pushing.replica_endpoint == ""


def test_a_slot_a_capture_claims_while_it_is_read_is_not_sealed(tmp_path: Path, parts) -> None:
    """The manifest changed between the look before and after the read: the bytes may be torn."""
    from mindft.replica.sources import FileSource

    store = SnapshotStore(home=tmp_path / "rank0")
    parts.append(store)
    capture(store, 1)
    source = FileSource(tmp_path / "rank0")
    [(step, index)] = source.notice()
    outgoing = source.open(0, index)
    sent = list(outgoing.parts(frozenset()))
    assert step == 1 and outgoing.intact() and outgoing.header.step == 1
    assert b"".join(data for _, _, data in sent) == b"".join(a.tobytes() for a in state(1).values())
    outgoing.close()
    outgoing = source.open(0, index)
    reading = outgoing.parts(frozenset())
    next(reading)
    capture(store, 2)
    capture(store, 3)  # claims the slot being read
    list(reading)
    assert not outgoing.intact()
    outgoing.close()
    outgoing.close()  # idempotent
