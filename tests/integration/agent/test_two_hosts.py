"""Two hosts: each node's mindft-launch in a network namespace of its own, a veth link between them.

examples/train_dp.py data-parallel, one rank per node, MCCL all-reducing across the link, the
job's key made by ``mindft keygen`` and shared by both nodes. A node is lost as a pod dies
(every process in its namespace SIGKILLed, its agent's shared memory gone) and started again 3 s
later as Volcano restarts a pod (node 0 with the controller and MindSpore's scheduler, too), or
never; a rank is killed at step 55 with the cadence the job chose; a partition takes the link
down for longer than every timeout. Each ends bit-identical to a one-host run of the same job, or
cleanly: dying gasps written and no process left in either namespace.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from harness import Hosts, Processes, assert_ranks_identical
from host_jobs import (PARTITION, PARTITION_REPAIR_TIMEOUT, STEPS, HostsJob, assert_nothing_left, launch_one_host,
                       made_hosts, references)
from mindft.exitcodes import ExitCode
from mindft.flow.gasp import Origin, manifest_name, read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.mindspore, pytest.mark.timeout(900)]

__all__ = ["references"]  # a fixture of host_jobs', used here


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    yield from made_hosts(2)

def test_node_1_lost_and_back_3_s_later_ends_bit_identical(hosts: Hosts, processes: Processes, tmp_path: Path,
                                                           references) -> None:
    job = HostsJob(hosts, processes, tmp_path)
    job.start_training()
    lost_at = job.lose("node1", 1)
    time.sleep(3.0)
    job.start("node1-again", 1)
    codes = {name: job.wait(name) for name in ("node0", "node1-again")}
    took = time.monotonic() - lost_at
    assert codes == {"node0": 0, "node1-again": 0}, job.outputs()
    again, node0 = job.output("node1-again"), job.output("node0")
    assert "this node replaces node 1, lost with rank(s) [1]" in again, again[-4000:]
    assert re.search(r"restored rank 1's replica of step \d+ from the keeper at tcp://10\.77\.0\.1:", again)
    assert "rank=1 NODE LOST" in node0
    assert_ranks_identical(tmp_path / "out", references("model"), 2)
    assert_nothing_left(hosts)
    print(f"node 1 lost and back 3 s later: both nodes exited 0 {took:.1f} s after the loss")


def test_a_partition_longer_than_every_timeout_ends_cleanly_with_dying_gasps(hosts: Hosts, processes: Processes,
                                                                              tmp_path: Path) -> None:
    job = HostsJob(hosts, processes, tmp_path, MINDFT_REPAIR_TIMEOUT=PARTITION_REPAIR_TIMEOUT)
    job.start_training()
    cut_at = time.monotonic()
    hosts.link(0, up=False)
    ended: dict[str, float] = {}
    deadline = cut_at + PARTITION
    while time.monotonic() < deadline:
        for name, launcher in job.launchers.items():
            if name not in ended and launcher.poll() is not None:
                ended[name] = time.monotonic() - cut_at
        time.sleep(0.2)
    hosts.link(0, up=True)
    codes = {name: job.wait(name) for name in ("node0", "node1")}
    assert set(ended) == {"node0", "node1"}, f"still running after a partition of {PARTITION:g} s:\n{job.outputs()}"
    assert codes == {"node0": ExitCode.DUMPED, "node1": ExitCode.DUMPED}, job.outputs()
    for node in (0, 1):
        # Neither side can tell a partition from the other's loss: each writes both ranks' state
        # (the other's from the replica it keeps), at one step of its own choosing.
        step, _, entries = read_manifest(json.loads((job.dump_dir(node) / manifest_name(node)).read_text()))
        assert step >= 0 and {rank: entry.origin is Origin.REPLICA for rank, entry in entries.items()} == \
            {node: False, 1 - node: True}, (node, entries)
        assert all((job.dump_dir(node) / entry.file).exists() for entry in entries.values())
    assert_nothing_left(hosts)
    print(f"partition: node 0 ended {ended['node0']:.1f} s, node 1 {ended['node1']:.1f} s after the link went down")


def test_node_0_lost_for_good_leaves_every_ranks_state_at_one_step_and_a_resume_ends_bit_identical(
        hosts: Hosts, processes: Processes, tmp_path: Path, references) -> None:
    """Node 0 (the controller, MindSpore's scheduler, rank 0) is lost and never comes back: node 1
    ends with a dying gasp of both ranks at one step, rank 0's from the replica node 1 kept, and
    the manifest says so; resuming from it on one host ends bit-identical to the fault-free run."""
    job = HostsJob(hosts, processes, tmp_path, "--loop")
    before = job.start_training()
    lost_at = job.lose("node0", 0)
    code = job.wait("node1")
    took = time.monotonic() - lost_at
    node1 = job.output("node1")
    assert code == ExitCode.DUMPED, job.outputs()
    step, world, entries = read_manifest(json.loads((job.dump_dir(1) / manifest_name(1)).read_text()))
    # Rank 0's replica may lag the step every rank finished by one snapshot (every step here).
    assert world == 2 and step >= before.step - 1 and sorted(entries) == [0, 1], (before.step, entries)
    assert (entries[0].origin, entries[0].node, entries[0].written_by) == (Origin.REPLICA, 0, 1)
    assert entries[1].origin in (Origin.RANK, Origin.MEMORY) and (entries[1].node, entries[1].written_by) == (1, 1)
    assert all(entry.step == step and (job.dump_dir(1) / entry.file).exists() for entry in entries.values())
    assert f"rank 0's node is gone: wrote the replica this node kept, step {step}" in node1, node1[-4000:]
    assert_nothing_left(hosts)
    print(f"node 0 lost for good: node 1 ended with its dying gasp {took:.1f} s after the loss (step {step})")
    resumed = launch_one_host(processes, tmp_path, "resumed", "--loop", "--resume", str(job.dump_dir(1)))
    assert f"all 2 ranks finished at step {STEPS - step};" in (tmp_path / "resumed.out").read_text()  # the rest only
    assert_ranks_identical(resumed, references("loop"), 2)


def test_node_0_lost_and_back_3_s_later_ends_bit_identical(hosts: Hosts, processes: Processes, tmp_path: Path,
                                                           references) -> None:
    """Node 0 (the controller, MindSpore's scheduler, its agent's memory, rank 0) is lost and its
    launcher started again 3 s later: the new controller learns from rank 1 and node 1's agent that
    the job was under way, every worker restarts behind a new scheduler, rank 0 from the replica
    node 1 kept, and the job ends bit-identical to the fault-free run."""
    job = HostsJob(hosts, processes, tmp_path)
    job.start_training()
    lost_at = job.lose("node0", 0)
    time.sleep(3.0)
    job.start("node0-again", 0)
    codes = {name: job.wait(name) for name in ("node0-again", "node1")}
    took = time.monotonic() - lost_at
    assert codes == {"node0-again": 0, "node1": 0}, job.outputs()
    again = job.output("node0-again")
    assert "the controller started again while the job was under way (node 0 lost with rank 0)" in again, again[-4000:]
    restored = re.search(r"restored rank 0's replica of step (\d+) from the keeper at tcp://10\.77\.0\.2:", again)
    assert restored and f"every rank holds step {restored[1]}" in again
    assert "a new MindSpore scheduler" in again
    assert_ranks_identical(tmp_path / "out", references("model"), 2)
    assert_nothing_left(hosts)
    recovery = re.search(r"recovery 1 done in ([\d.]+) s", again)[1]
    print(f"node 0 lost and back 3 s later: both nodes exited 0 {took:.1f} s after the loss; the recovery took "
          f"{recovery} s from the new controller's decision (rollback to step {restored[1]})")


def test_a_rank_killed_at_step_55_replays_no_more_than_the_cadence_its_budget_chose(
        hosts: Hosts, processes: Processes, tmp_path: Path, references) -> None:
    """The job chooses its snapshot cadence within its overhead budget (1%) from warm samples only
    (the first, with the replica's connection set-up, would have set a cadence ten times too
    long): rank 1 killed at step 55 makes the job replay at most that cadence's steps."""
    # No MINDFT_SNAPSHOT_EVERY: the job chooses the cadence.
    job = HostsJob(hosts, processes, tmp_path, MINDFT_SNAPSHOT_EVERY=None)
    job.start_training()
    before = job.until("step 55", lambda status: status.step >= 55)
    victim = next(row for row in before.ranks if row.rank == 1)
    os.kill(victim.pid, signal.SIGKILL)
    codes = {name: job.wait(name) for name in ("node0", "node1")}
    assert codes == {"node0": 0, "node1": 0}, job.outputs()
    node0 = job.output("node0")
    rollback = int(re.search(r"every rank holds step (\d+)", node0)[1])
    fault_step = victim.step + 1  # the step it was killed in, or one before: its last report may be lost with it
    replayed = fault_step - rollback
    changes = [(int(every), int(start)) for every, start in
               re.findall(r"snapshot cadence \d+ -> every (\d+) steps from step (\d+)", node0)]
    assert changes, node0[-4000:]
    # The cadence in force at the fault (the job may have announced the next one already).
    every = next(every for every, start in reversed([(1, 0), *changes]) if start <= fault_step)
    assert replayed <= every, (fault_step, rollback, changes)
    assert_ranks_identical(tmp_path / "out", references("model"), 2)
    print(f"rank 1 killed in step {fault_step}: rolled back to step {rollback}, {replayed} step(s) replayed; "
          f"the cadence then: every {every} steps; its changes (every, from step): {changes}")
