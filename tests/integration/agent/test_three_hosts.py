"""No node is indispensable, on three hosts (network namespaces on one bridge): node 0, node 1
and a warm spare (``mindft-launch --spare``), the data-parallel job of examples/train_dp.py across
them, each scenario ending bit-identical to a fault-free run with nothing left running:

- node 1 lost for good: the controller gives it to the spare; its launcher, started again after
  that, finds its node given away and waits as a spare itself;
- node 0 lost for good, ``--standbys 1``: node 1's standby takes command in term 1 and the spare
  takes rank 0; node 0 back on its old address after that is fenced and waits as a spare;
- a partition around node 0 and its controller: one controller in command at any time;
- node 0 back on another host under the same name (``--master-addr`` a name): found there;
- a node flagged slow (``MINDFT_SLOW_ACTION=spare``): given to the spare.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Iterator

import pytest

from harness import Hosts, Processes, Throttle, assert_ranks_identical
from host_jobs import HostsJob, assert_nothing_left, launch_one_host, made_hosts, references
from mindft.observe.events import ControllerFollowed, NodeGiven, TookCommand, read

pytestmark = [pytest.mark.slow, pytest.mark.mindspore, pytest.mark.timeout(900)]

__all__ = ["references"]  # a fixture of host_jobs', used here

SPARE_HOST = 2


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    yield from made_hosts(3)


def test_node_1_lost_for_good_the_spare_takes_its_rank_and_the_job_ends_bit_identical(
        hosts: Hosts, processes: Processes, tmp_path: Path, references) -> None:
    job = HostsJob(hosts, processes, tmp_path)
    job.start("spare", None, host=SPARE_HOST)
    job.start_training()
    lost_at = job.lose("node1", 1)
    spare_line = "this spare becomes node 1 (adoption 1)"
    while spare_line not in job.output("spare"):
        assert time.monotonic() - lost_at < 60, job.outputs()
        assert job.launchers["spare"].poll() is None, job.outputs()
        time.sleep(0.2)
    given_after = time.monotonic() - lost_at
    job.start("node1-again", 1)  # the lost node's pod, back after its node was given away
    codes = {name: job.wait(name) for name in ("node0", "spare", "node1-again")}
    took = time.monotonic() - lost_at
    assert codes == {"node0": 0, "spare": 0, "node1-again": 0}, job.outputs()
    spare, again, node0 = job.output("spare"), job.output("node1-again"), job.output("node0")
    restored = re.search(r"restored rank 1's replica of step (\d+) from the keeper at tcp://10\.77\.0\.1:", spare)
    assert restored, spare[-4000:]
    assert f"every rank holds step {restored[1]}" in node0, node0[-4000:]
    assert "node 1 was given to a spare (adoption 1" in again and "this agent is a warm spare now" in again, again
    assert "the job is done: this spare was not needed" in again
    given = [e.record for e in read(tmp_path / "run-node0") if isinstance(e.record, NodeGiven)]
    assert [(g.node, g.adoption) for g in given] == [(1, 1)] and "silent for" in given[0].reason
    assert_ranks_identical(tmp_path / "out", references("model"), 2)
    assert_nothing_left(hosts)
    recovery = re.search(r"recovery 1 done in ([\d.]+) s", node0)
    print(f"node 1 lost for good: given to the spare {given_after:.1f} s after the loss; the recovery took "
          f"{recovery[1] if recovery else '?'} s (rollback to step {restored[1]}); every launcher exited 0 "
          f"{took:.1f} s after the loss")


def test_node_0_lost_for_good_the_standby_takes_command_the_spare_takes_rank_0_and_the_job_ends_bit_identical(
        hosts: Hosts, processes: Processes, tmp_path: Path, references) -> None:
    """Node 0 (the controller, MindSpore's scheduler, rank 0) is lost for good: node 1's standby
    controller takes command in term 1, gives node 0 to the spare, which restores rank 0's replica
    from node 1's keeper, and every worker restarts behind a scheduler on node 1."""
    job = HostsJob(hosts, processes, tmp_path, launch_args=("--standbys", "1"))
    job.start("spare", None, host=SPARE_HOST)
    job.start_training()
    lost_at = job.lose("node0", 0)
    codes = {name: job.wait(name) for name in ("node1", "spare")}
    took = time.monotonic() - lost_at
    assert codes == {"node1": 0, "spare": 0}, job.outputs()
    node1, spare = job.output("node1"), job.output("spare")
    assert "this standby controller on node 1 takes command of the job (term 1)" in node1, node1[-4000:]
    assert "this spare becomes node 0 (adoption 1)" in spare, spare[-4000:]
    restored = re.search(r"restored rank 0's replica of step (\d+) from the keeper at tcp://10\.77\.0\.2:", spare)
    assert restored and f"every rank holds step {restored[1]}" in node1, (spare[-3000:], node1[-3000:])
    assert "MindSpore's scheduler" in node1 and "moved to this node: 10.77.0.2:" in node1
    records = [e.record for e in read(tmp_path / "run-node1")]
    took_command = [r for r in records if isinstance(r, TookCommand)]
    assert [(r.node, r.old_term, r.term) for r in took_command] == [(1, 0, 1)], records
    assert [(r.node, r.adoption) for r in records if isinstance(r, NodeGiven)] == [(0, 1)]
    followed = [r for r in records if isinstance(r, ControllerFollowed)]
    assert [(r.old, r.new, r.term, r.here) for r in followed] == \
        [("tcp://10.77.0.1:29601", "tcp://10.77.0.2:29601", 1, True)] and followed[0].silent > 4
    assert_ranks_identical(tmp_path / "out", references("model"), 2)
    assert_nothing_left(hosts)
    recovery = re.search(r"recovery 1 done in ([\d.]+) s", node1)
    print(f"node 0 lost for good: node 1's standby took command, the spare took rank 0; the rebuild took "
          f"{recovery[1] if recovery else '?'} s (rollback to step {restored[1]}); node 1 and the spare exited 0 "
          f"{took:.1f} s after the loss")


def test_node_0_back_on_its_old_address_after_the_takeover_is_fenced_and_waits_as_a_spare(
        hosts: Hosts, processes: Processes, tmp_path: Path, references) -> None:
    """Node 0 is lost, node 1's standby takes command (term 1) and the spare takes rank 0; then node
    0's launcher starts again on its old address, with a controller of term 0 that knows nothing.
    The controller in command tells it so (Superseded): it stands down before it commands anything
    of the job, its agent waits as a spare of term 1, and the job ends bit-identical."""
    job = HostsJob(hosts, processes, tmp_path, launch_args=("--standbys", "1"))
    job.start("spare", None, host=SPARE_HOST)
    job.start_training()
    lost_at = job.lose("node0", 0)
    while "takes command of the job (term 1)" not in job.output("node1"):
        assert time.monotonic() - lost_at < 60, job.outputs()
        time.sleep(0.2)
    job.start("node0-again", 0)
    codes = {name: job.wait(name) for name in ("node1", "spare", "node0-again")}
    assert codes == {"node1": 0, "spare": 0, "node0-again": 0}, job.outputs()
    again = job.output("node0-again")
    assert "the job is commanded in term 1 at tcp://10.77.0.2:29601; this controller (term 0) stands down" in again
    assert "this agent is a warm spare now, of the controller at tcp://10.77.0.2:29601" in again, again[-4000:]
    assert "the job is done: this spare was not needed" in again
    # The returning controller ordered nothing: no order in its event log.
    assert not [e for e in read(tmp_path / "run-node0-again") if e.kind == "order"]
    assert_ranks_identical(tmp_path / "out", references("model"), 2)
    assert_nothing_left(hosts)


def test_a_partition_that_cuts_node_0_off_with_its_controller_leaves_one_controller_in_command(
        hosts: Hosts, processes: Processes, tmp_path: Path, references) -> None:
    """Node 0's link goes down (node 0, its controller and rank 0 on one side; node 1 and the spare
    on the other) and stays down until the other side trains again: node 1's standby takes command
    (half of the node agents follow it), the spare takes rank 0, the job goes on; once the link is
    back, node 0's controller hears that term 1 commands and stands down. The event logs show the
    two controllers' orders one after the other, never interleaved; the job ends bit-identical."""
    job = HostsJob(hosts, processes, tmp_path, launch_args=("--standbys", "1"))
    job.start("spare", None, host=SPARE_HOST)
    job.start_training()
    hosts.link(0, up=False)
    cut_at, cut_wall = time.monotonic(), time.time()
    while not re.search(r"takes command of the job \(term 1\)[\s\S]*RESUMING → NORMAL", job.output("node1")):
        assert time.monotonic() - cut_at < 120, job.outputs()
        time.sleep(0.2)
    hosts.link(0, up=True)
    healed_after = time.monotonic() - cut_at
    codes = {name: job.wait(name) for name in ("node0", "node1", "spare")}
    assert codes == {"node0": 0, "node1": 0, "spare": 0}, job.outputs()
    node0 = job.output("node0")
    assert "the job is commanded in term 1 at tcp://10.77.0.2:29601; this controller (term 0) stands down" in node0
    old = read(tmp_path / "run-node0")
    new = read(tmp_path / "run-node1")
    took = next(e.at for e in new if isinstance(e.record, TookCommand))
    old_orders = [e.at for e in old if e.kind in ("order", "node_given")]
    new_orders = [e.at for e in new if e.kind in ("order", "node_given")]
    assert new_orders and all(at < took for at in old_orders), (old_orders, took)
    assert all(at >= took for at in new_orders)
    assert_ranks_identical(tmp_path / "out", references("model"), 2)
    assert_nothing_left(hosts)
    print(f"partition around node 0: node 1's standby took command {took - cut_wall:.1f} s after the cut; the link "
          f"came back {healed_after:.1f} s after it; node 0 stood down, every launcher exited 0")


def test_node_0_back_on_another_host_under_its_name_is_found_there(
        hosts: Hosts, processes: Processes, tmp_path: Path, references) -> None:
    """``--master-addr`` is a name (a Volcano pod's): node 0 is lost and its pod comes back on
    another host, with another address, under the same name. Node 1's agent looks the name up again
    while the controller is silent, finds the new controller there, and the job is rebuilt behind
    it: bit-identical."""
    for host in range(3):
        hosts.name(host, "mindft-master", Hosts.ADDRESSES[0])
    job = HostsJob(hosts, processes, tmp_path, master_addr="mindft-master", MINDFT_CONNECT_RETRIES="10")
    job.start_training()
    job.lose("node0", 0)
    for host in range(3):
        hosts.name(host, "mindft-master", Hosts.ADDRESSES[2])
    job.controller_host = 2
    job.start("node0-moved", 0, host=2)
    codes = {name: job.wait(name) for name in ("node1", "node0-moved")}
    assert codes == {"node1": 0, "node0-moved": 0}, job.outputs()
    node1, moved = job.output("node1"), job.output("node0-moved")
    assert "mindft-master now resolves to 10.77.0.3 (was 10.77.0.1): the controller moved there" in node1, node1[-3000:]
    assert "the controller started again while the job was under way (node 0 lost with rank 0)" in moved
    assert re.search(r"restored rank 0's replica of step \d+ from the keeper at tcp://10\.77\.0\.2:", moved)
    assert_ranks_identical(tmp_path / "out", references("model"), 2)
    assert_nothing_left(hosts)


def test_a_slow_node_is_given_to_the_spare_and_the_job_ends_bit_identical(
        hosts: Hosts, processes: Processes, tmp_path: Path) -> None:
    """MINDFT_SLOW_ACTION=spare: rank 1 (node 1) held to a third of the CPU is flagged slow after two
    windows; its node is given to the spare, which restores rank 1's replica from node 0's keeper, and
    node 1's agent stops its rank and waits as a spare itself. The job ends bit-identical."""
    # 384 steps of compute alone (a sleep would not slow down under SIGSTOP): time to be flagged, moved, train on.
    epochs = ("--epochs", "24", "--step-seconds", "0")
    job = HostsJob(hosts, processes, tmp_path, *epochs, MINDFT_SLOW_ACTION="spare", MINDFT_SLOW_WINDOW="3",
                   MINDFT_SLOW_WINDOWS="2", MINDFT_SLOW_THRESHOLD="0.3")
    job.start("spare", None, host=SPARE_HOST)
    status = job.start_training()
    throttle = Throttle(next(r.pid for r in status.ranks if r.rank == 1), 1 / 3)
    try:
        started = time.monotonic()
        while "this spare becomes node 1 (adoption 1)" not in job.output("spare"):
            assert time.monotonic() - started < 90, job.outputs()
            time.sleep(0.2)
    finally:
        throttle.stop()
    codes = {name: job.wait(name) for name in ("node0", "node1", "spare")}
    assert codes == {"node0": 0, "node1": 0, "spare": 0}, job.outputs()
    node1 = job.output("node1")
    assert "node 1 was given to a spare (adoption 1" in node1 and "this agent is a warm spare now" in node1, node1
    given = [e.record for e in read(tmp_path / "run-node0") if isinstance(e.record, NodeGiven)]
    assert [(g.node, g.adoption) for g in given] == [(1, 1)] and "rank 1 (node 1) is slow" in given[0].reason
    assert_ranks_identical(tmp_path / "out", launch_one_host(processes, tmp_path, "reference", *epochs), 2)
    assert_nothing_left(hosts)
