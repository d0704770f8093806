"""A node lost with its agent's memory: two mindft-launch processes on loopback as nodes 0 and 1.

Node 1 (its launcher, its rank and the shared memory holding the rank's snapshots) is killed;
a new launcher for node 1 takes its place, as MindCluster reschedules a pod. Its agent finds
the job running, restores rank 1's replica from node 0's keeper into its own memory, reports
the loss (NodeLost) and starts rank 1 again: every rank rolls back to the replica's step and
the job ends bit-identical. When no replica can be restored, the job ends with dying-gasp
checkpoints at once instead of a recovery that would lose rank 1's state.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import psutil
import pytest

import fake_rank
from harness import FAKE_RANK, Processes, free_port_pair
from mindft.net.channel import Client, ControllerUnreachable
from mindft.net.keys import generate_keys, load_keys
from mindft.observe.units import size_from_text

pytestmark = pytest.mark.slow

RANK_SCRIPT = FAKE_RANK
STEPS = 40
DEADLINE = 120.0


class Nodes:
    """The launchers a test starts, each on its own output file; every process they started dies at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.port = free_port_pair()
        self.key_file = tmp_path / "keys.json"
        generate_keys(self.key_file)
        self.keys = load_keys(self.key_file)
        self.env = {**os.environ, "LAUNCH_DIR": str(tmp_path), "LAUNCH_STEPS": str(STEPS),
                    "LAUNCH_STEP_TIME": "0.1", "LAUNCH_NO_FILE_REPLICA": "1", "MINDFT_SNAPSHOT_EVERY": "1",
                    "MINDFT_HEARTBEAT_INTERVAL": "0.1", "MINDFT_REPAIR_TIMEOUT": "90",
                    "MINDFT_RESET_FILE": str(tmp_path / "reset.json"), "MS_ENABLE_TFT": "{RSC:1}",
                    "MINDFT_DUMP_DIR": str(tmp_path / "dumps")}
        for name in ("MINDFT_KEY_FILE", "MINDFT_INSECURE", "MINDFT_RESTART_SCOPE", "MINDFT_AGENT_REPLICATION"):
            self.env.pop(name, None)
        self.launchers: dict[str, subprocess.Popen] = {}
        self.processes = Processes()
        self.client = Client(f"127.0.0.1:{self.port + 1}", self.keys, timeout=2.0)

    def start(self, name: str, node: int, **env: str) -> None:
        self.launchers[name] = self.processes.start(
            [sys.executable, "-m", "mindft.cli.launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node),
             "--master-port", str(self.port), "--no-scheduler", "--key-file", str(self.key_file),
             "--run-dir", str(self.tmp_path / f"run-{name}"), str(RANK_SCRIPT)],
            {**self.env, **env}, self.tmp_path / f"{name}.out")

    def output(self, name: str) -> str:
        return (self.tmp_path / f"{name}.out").read_text(errors="replace")

    def until(self, what: str, check) -> object:
        deadline = time.monotonic() + DEADLINE
        while True:
            self.processes.remember_all()
            try:
                status = self.client.status()
            except ControllerUnreachable:
                status = None
            found = check(status) if status is not None else None
            if found:
                return found
            assert time.monotonic() < deadline, f"{what}: {status}\n" + "\n".join(
                f"--- {name}\n{self.output(name)[-3000:]}" for name in self.launchers)
            time.sleep(0.1)

    def lose(self, name: str) -> None:
        """The node dies: its launcher and everything it started, at once (no exit is reported),
        and the shared memory its agent held (the ranks' snapshots, the replicas it kept)."""
        self.processes.remember_all()
        launcher = psutil.Process(self.launchers[name].pid)
        victims = [launcher, *launcher.children(recursive=True)]
        for process in victims:
            process.kill()
        psutil.wait_procs(victims, timeout=10)
        self.launchers[name].wait(10)
        memory = re.search(r"the ranks' snapshots live in (\S+) \(shared memory", self.output(name))
        assert memory, self.output(name)
        shutil.rmtree(memory[1], ignore_errors=True)  # another job's launcher may have removed it (gone owner)

    def wait(self, name: str) -> int:
        try:
            return self.launchers[name].wait(DEADLINE)
        finally:
            self.processes.remember_all()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    started = Nodes(tmp_path)
    yield started
    started.processes.kill_all()


def rows(status) -> dict:
    return {row.rank: row for row in status.ranks}


@pytest.mark.parametrize("data_parallel", [False, True], ids=["own-weights", "data-parallel"])
def test_a_lost_node_comes_back_from_its_replica_on_the_next_node(nodes: Nodes, tmp_path: Path,
                                                                  data_parallel: bool) -> None:
    """Data-parallel ranks hold the same weights: node 0's keeper received only rank 1's position
    and restores the weights from rank 0's snapshot of the same step."""
    if data_parallel:
        nodes.env["LAUNCH_DATA_PARALLEL"] = "1"
    # Rank 1 is stopped until its newest snapshot is on node 0: 0.6 s of silence would have it
    # found hung (and restarted) first whenever replication is slow on a loaded machine.
    nodes.env["MINDFT_HEARTBEAT_MISSES"] = "30"
    nodes.start("node1", 1)
    nodes.start("node0", 0)
    nodes.until("both ranks training, rank 1 replicated",
                lambda s: s.state == "NORMAL" and s.step >= 5 and rows(s)[1].replicated >= 3)
    # Rank 1 stops where it is; once its newest snapshot is on node 0 its node is lost. (Rank 0
    # can get at most one snapshot ahead of it: the step it rolls back to is one both hold.)
    victim = rows(nodes.client.status())[1].pid
    os.kill(victim, signal.SIGSTOP)
    held = nodes.until("rank 1's newest snapshot replicated",
                       lambda s: rows(s)[1].replicated >= rows(s)[1].step and rows(s)[1].replicated)
    nodes.lose("node1")
    nodes.until("rank 1 found silent", lambda s: s.state in ("PAUSING", "REPAIRING"))
    nodes.start("node1-new", 1)
    codes = {name: nodes.wait(name) for name in ("node1-new", "node0")}
    node0, new = nodes.output("node0"), nodes.output("node1-new")
    assert codes == {"node1-new": 0, "node0": 0}, node0[-4000:] + new[-4000:]
    assert "this node replaces node 1, lost with rank(s) [1]" in new
    restored = int(re.search(r"restored rank 1's replica of step (\d+) from the keeper at tcp://", new)[1])
    assert restored >= held
    assert "rank=1 NODE LOST" in node0 and f"its new node restored its replica of step {restored}" in node0
    assert f"every rank holds step {restored}" in node0
    assert f"[rank 1] rank 1 ROLLBACK step {restored}" in new  # from its agent's memory, not a file
    shared = re.search(r"received (.+?), shared (.+?) with this node's snapshots", node0)
    assert shared, node0[-3000:]
    received, pointed = (size_from_text(text) for text in shared.groups())
    if data_parallel:  # per push: 16 B of position received, 512 B of weights shared
        assert 0 < received < pointed / 10, shared[0]
    else:
        assert pointed == 0 < received, shared[0]
    # A snapshot every step: the keeper moved each replica to disk when the next began, and
    # deleted the files when the job ended.
    assert int(re.search(r"(\d+) moved to disk while the next arrived", node0)[1]) > 0, node0[-3000:]
    assert not (tmp_path / "dumps" / "replica-spill").exists()
    references = {rank: fake_rank.reference(rank if not data_parallel else 0, STEPS) for rank in (0, 1)}
    for rank in (0, 1):
        final = np.load(tmp_path / f"final-{rank}.npy")
        assert final.tobytes() == references[rank].tobytes(), f"rank {rank} differs"


def test_a_lost_node_without_a_replica_ends_with_dying_gasps_at_once(nodes: Nodes, tmp_path: Path) -> None:
    nodes.start("node1", 1)
    nodes.start("node0", 0)
    nodes.until("both ranks training", lambda s: s.state == "NORMAL" and s.step >= 5)
    nodes.lose("node1")
    nodes.until("rank 1 found silent", lambda s: s.state in ("PAUSING", "REPAIRING"))
    # The new node's agent replicates nothing, so it has nothing to restore.
    nodes.start("node1-new", 1, MINDFT_AGENT_REPLICATION="0")
    codes = {name: nodes.wait(name) for name in ("node1-new", "node0")}
    node0, new = nodes.output("node0"), nodes.output("node1-new")
    assert codes == {"node1-new": 1, "node0": 3}, node0[-4000:] + new[-4000:]
    assert "no replica to restore: the node agents do not replicate" in new
    assert "the job ended before this node's ranks could rejoin it" in new and "[rank 1]" not in new
    assert ("node 1 lost: rank 1 only to nothing (no replica) can roll back; rank 0 holds" in node0
            and "dying-gasp checkpoints instead of a recovery that would lose the lost ranks' state" in node0)
    assert "timed out" not in node0  # decided when the loss was reported, not at timeouts.repair
    assert list((tmp_path / "dumps").glob("rank0-step*.npy"))


def test_node_0_lost_with_the_controller_and_back_ends_bit_identical(nodes: Nodes, tmp_path: Path) -> None:
    """Node 0 runs the controller: its launcher, rank 0 and its agent's memory are lost, and a new
    launcher for node 0 starts 1 s later. The new controller learns from rank 1 (which reconnects,
    saying how far it got) and node 1's agent (what it runs, holds and keeps) that the job was
    under way, restarts every worker, rank 0 from the replica node 1 kept, and the job ends as if
    nothing had happened."""
    nodes.env["MINDFT_HEARTBEAT_MISSES"] = "30"  # rank 0 is stopped below: it must not be found hung first
    nodes.env["MINDFT_CONNECT_RETRIES"] = "10"   # rank 1 waits 10 × 3 s for a controller started again
    nodes.start("node0", 0)
    nodes.start("node1", 1)
    nodes.until("both ranks training, rank 0 replicated",
                lambda s: s.state == "NORMAL" and s.step >= 5 and rows(s)[0].replicated >= 3)
    os.kill(rows(nodes.client.status())[0].pid, signal.SIGSTOP)
    held = nodes.until("rank 0's newest snapshot replicated",
                       lambda s: rows(s)[0].replicated >= rows(s)[0].step and rows(s)[0].replicated)
    nodes.lose("node0")
    time.sleep(1.0)
    nodes.start("node0-new", 0)
    codes = {name: nodes.wait(name) for name in ("node0-new", "node1")}
    new, node1 = nodes.output("node0-new"), nodes.output("node1")
    assert codes == {"node0-new": 0, "node1": 0}, new[-4000:] + node1[-4000:]
    assert "the controller started again while the job was under way (node 0 lost with rank 0)" in new
    restored = int(re.search(r"restored rank 0's replica of step (\d+) from the keeper at tcp://", new)[1])
    assert restored >= held
    assert f"every rank holds step {restored}" in new
    assert f"[rank 0] rank 0 ROLLBACK step {restored}" in new
    for rank in (0, 1):
        final = np.load(tmp_path / f"final-{rank}.npy")
        assert final.tobytes() == fake_rank.reference(rank, STEPS).tobytes(), f"rank {rank} differs"
