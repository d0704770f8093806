"""Elastic data parallelism on three hosts (network namespaces on one bridge), no spare:
examples/train_elastic.py started with ``--nnodes 2:3``, one rank per node, MCCL all-reducing across
the links. A node lost for good leaves the job on the other two; every sample of every epoch is used
once (each process records the sample ids of every step it completes), and the final weights are
bit-identical to a fault-free run that changes its world size after the same step (the step the job
rolled back to, read from the event log): that step on three ranks, the rest on two. The first
scenario trains with the custom loop (``FaultTolerantLoop.shares``), the second with ``Model.train``
(``mindft.mindspore.train`` over ``elastic_dataset``), the third with MindFormers' Trainer (a pure
data-parallel yaml over ``elastic_dataset``, examples/mindformers/train_llama_elastic.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from harness import ROOT, Hosts, Processes, assert_ranks_identical, environment, free_port_pair, require
from host_jobs import TIMEOUTS, HostsJob, assert_nothing_left, made_hosts
from mindft.observe.events import JobMoved, WorldResized, read
from mindft.rank.data import GlobalBatches

pytestmark = [pytest.mark.slow, pytest.mark.mindspore, pytest.mark.timeout(900)]

SCRIPT = ROOT / "examples" / "train_elastic.py"
STEPS, GLOBAL_BATCH, SAMPLES, SEED = 96, 12, 120, 1  # 9.6 epochs; the script's other defaults
JOB_ARGS = ("--steps", str(STEPS), "--step-seconds", "0.15")
# MindFormers' Trainer: the same stream (its yaml's seed), MindFormers imported before the workers fork.
TRAINER = ROOT / "examples" / "mindformers" / "train_llama_elastic.py"
TRAINER_YAML = ROOT / "examples" / "mindformers" / "tiny_llama.yaml"
TRAINER_SEED, TRAINER_STEPS = 42, 80


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    yield from made_hosts(3)


def trained(records: Path) -> dict[int, tuple[int, list[list[int]]]]:
    """Step → (its world size, each rank's sample ids), as the job finally trained it: of the records
    of a step (a step rolled back is trained again), each rank's last."""
    last: dict[tuple[int, int], dict] = {}
    for path in records.glob("steps-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            key = (entry["step"], entry["rank"])
            if key not in last or entry["t"] > last[key]["t"]:
                last[key] = entry
    steps: dict[int, tuple[int, list[list[int]]]] = {}
    for step in sorted({s for s, _ in last}):
        newest = max((e for (s, _), e in last.items() if s == step), key=lambda e: e["t"])
        world = newest["world"]
        steps[step] = (world, [last[(step, rank)]["indices"] for rank in range(world)])
    return steps


def assert_every_sample_used_once(steps: dict[int, tuple[int, list[list[int]]]], last: int = STEPS,
                                  seed: int = SEED) -> None:
    assert sorted(steps) == list(range(1, last + 1)), sorted(steps)
    used = [i for step in sorted(steps) for share in steps[step][1] for i in share]
    data = GlobalBatches(SAMPLES, GLOBAL_BATCH, seed)
    assert used == [i for step in range(1, last + 1) for i in data.batch(step).tolist()]
    epochs = len(used) // SAMPLES
    for epoch in range(epochs):
        assert sorted(used[epoch * SAMPLES:(epoch + 1) * SAMPLES]) == list(range(SAMPLES)), f"epoch {epoch}"
    rest = used[epochs * SAMPLES:]  # the epoch under way
    assert len(set(rest)) == len(rest)


def reference(processes: Processes, tmp: Path, worlds: list[tuple[int, int]], *script_args: str,
              script: Path = SCRIPT, **env: str) -> Path:
    """A fault-free run on one host that trains ``worlds`` = [(ranks, up to step)...] one after the
    other, each part starting from the state the previous one wrote, ``script`` with ``script_args``;
    its final weights' directory."""
    start, state = 0, None
    for part, (ranks, until) in enumerate(worlds):
        out = tmp / f"reference-{part}"
        argv = [sys.executable, "-m", "mindft.cli.launch", "--nproc", str(ranks), "--master_port",
                str(free_port_pair()), "--run-dir", str(tmp / f"reference-run-{part}"), "--cluster_time_out", "120",
                str(script), *script_args, "--steps", str(until), "--start", str(start), "--out", str(out),
                *(("--load", str(state)) if state is not None else ())]
        code, output = processes.run(argv, environment(tmp, MS_ENABLE_TFT="{RSC:1}", **TIMEOUTS, **env),
                                     tmp / f"reference-{part}.out")
        assert code == 0, output[-4000:]
        start, state = until, out / "rank0.npz"
    return out


def rollbacks(events: list) -> list[int]:
    """The step each resize rolled back to (the first 'every rank restored step K' after it)."""
    steps = []
    for resized in (e for e in events if isinstance(e.record, WorldResized)):
        restored = (re.search(r"every rank restored step (\d+)", e.record.reason) for e in events
                    if isinstance(e.record, JobMoved) and e.at > resized.at)
        steps.append(int(next(found for found in restored if found)[1]))
    return steps


def shrink_then_grow(job: HostsJob, tmp: Path) -> tuple[int, int, float]:
    """Node 2 lost for good; once the job goes on without it, node 2's launcher again, which waits as
    a spare until the job grows back to three nodes. Checks what the launchers and the event log say;
    returns the steps the shrink and the growth rolled back to, and the seconds from the loss until
    every launcher exited 0."""
    job.start_training()
    lost_at = job.lose("node2", 2)
    while "the job of 2 rank(s) is rebuilt" not in job.output("node0"):
        assert time.monotonic() - lost_at < 120, job.outputs()
        time.sleep(0.2)
    job.start("node2-again", 2)  # node 2's launcher back after the job went on without it
    codes = {name: job.wait(name) for name in ("node0", "node1", "node2-again")}
    took = time.monotonic() - lost_at
    assert codes == {"node0": 0, "node1": 0, "node2-again": 0}, job.outputs()
    node0, again = job.output("node0"), job.output("node2-again")
    assert "node 2 lost for good" in node0 and "the job goes on with 2 of 3 nodes (MIN 2)" in node0, node0[-4000:]
    # Node 0 kept node 2's replicas, then node 1's: each resize frees them (the new ring replicates anew).
    assert node0.count("dropped the replicas of the previous ring") == 2, node0[-4000:]
    assert "node 2 was left behind; this agent waits as a spare" in again, again[-4000:]
    assert "this spare becomes node 2 of 3" in again and "a copy of rank " in again, again[-4000:]
    events = read(tmp / "run-node0")
    resized = [e.record for e in events if isinstance(e.record, WorldResized)]
    assert [(r.members, r.lost, r.world_size, r.term) for r in resized] == \
        [([0, 1], [2], 2, 1), ([0, 1], [], 3, 2)], events
    shrunk, grown = rollbacks(events)
    told = subprocess.run([sys.executable, "-m", "mindft.cli.main", "events", "--job", str(tmp / "run-node0")],
                          capture_output=True, text=True, timeout=60, env=environment(tmp))
    assert told.returncode == 0 and "world resized to 2 rank(s) (term 1" in told.stdout, told.stdout + told.stderr
    assert "world resized to 3 rank(s) (term 2" in told.stdout
    return shrunk, grown, took


def test_node_2_lost_for_good_then_back_the_job_shrinks_to_two_grows_back_to_three_every_sample_once(
        hosts: Hosts, processes: Processes, tmp_path: Path) -> None:
    """Node 2 lost for good: the job goes on with nodes 0 and 1; node 2's launcher, started again,
    finds its node left behind and waits as a spare, and the job grows back to three nodes at the
    next snapshot boundary, node 2's rank starting from a peer's state. Bit-identical to a fault-free
    run that trains on three ranks, two, then three, switching at the same steps."""
    records = tmp_path / "records"
    job = HostsJob(hosts, processes, tmp_path, "--record", str(records), nodes=3, node_range="2:3",
                   script=SCRIPT, job_args=JOB_ARGS, MINDFT_SHRINK_AFTER="3")
    shrunk, grown, took = shrink_then_grow(job, tmp_path)
    steps = trained(records)
    assert [steps[s][0] for s in (shrunk, shrunk + 1, grown, grown + 1)] == [3, 2, 2, 3], (shrunk, grown)
    assert_every_sample_used_once(steps)
    reference_out = reference(processes, tmp_path, [(3, shrunk), (2, grown), (3, STEPS)], "--api", "loop")
    assert_ranks_identical(tmp_path / "out", reference_out, 3)
    assert_nothing_left(hosts)
    print(f"node 2 lost for good: the job went on with 2 nodes from step {shrunk}, grew back to 3 from step "
          f"{grown}; every launcher exited 0 {took:.1f} s after the loss")


def test_mindformers_trainer_shrinks_to_two_and_grows_back_to_three_every_sample_once(
        hosts: Hosts, processes: Processes, tmp_path: Path) -> None:
    """The same with MindFormers' Trainer on a pure data-parallel yaml (parallel_mode 0: MindFormers
    takes data_parallel from the world size): three ranks of 4 sequences, two of 6, then three of 4,
    every sequence once, bit-identical (weights and AdamW's moments) to a fault-free run that
    switches at the same steps, each part resuming from the state the previous one wrote."""
    require("mindformers", "MindFormers is not installed (docs/mindformers.md: Installing)")
    records, logs = tmp_path / "records", tmp_path / "mindformers"
    trainer_args = ("--config", str(TRAINER_YAML), "--output-dir", str(logs))
    # MindFormers logs to LOCAL_DEFAULT_PATH before it reads the yaml; the workers fork from a
    # process that imported it (docs/mindformers.md).
    mindformers = {"LOCAL_DEFAULT_PATH": str(logs), "MINDFT_PRELOAD": "mindspore,mindformers"}
    job = HostsJob(hosts, processes, tmp_path, "--record", str(records), nodes=3, node_range="2:3", script=TRAINER,
                   job_args=(*trainer_args, "--steps", str(TRAINER_STEPS), "--step-seconds", "0.15"),
                   MINDFT_SHRINK_AFTER="3", **mindformers)
    shrunk, grown, took = shrink_then_grow(job, tmp_path)
    steps = trained(records)
    assert [steps[s][0] for s in (shrunk, shrunk + 1, grown, grown + 1)] == [3, 2, 2, 3], (shrunk, grown)
    assert_every_sample_used_once(steps, TRAINER_STEPS, TRAINER_SEED)
    reference_out = reference(processes, tmp_path, [(3, shrunk), (2, grown), (3, TRAINER_STEPS)], *trainer_args,
                              script=TRAINER, **mindformers)
    assert_ranks_identical(tmp_path / "out", reference_out, 3, moments="adam_m.")
    assert_nothing_left(hosts)
    print(f"MindFormers' Trainer, node 2 lost for good: the job went on with 2 nodes from step {shrunk}, grew "
          f"back to 3 from step {grown}; every launcher exited 0 {took:.1f} s after the loss")


def test_node_0_lost_for_good_the_standby_goes_on_with_nodes_1_and_2_model_train_every_sample_once(
        hosts: Hosts, processes: Processes, tmp_path: Path) -> None:
    """Node 0 (the controller, MindSpore's scheduler, rank 0) is lost for good and no spare is there:
    node 1's standby takes command (term 1), no agent speaks for node 0 within --shrink-after, and
    nodes 1 and 2 go on as nodes 0 and 1 (term 2) behind a scheduler on node 1's host. Trained with
    Model.train."""
    records = tmp_path / "records"
    job = HostsJob(hosts, processes, tmp_path, "--record", str(records), nodes=3, node_range="2:3",
                   script=SCRIPT, job_args=(*JOB_ARGS, "--api", "model"), launch_args=("--standbys", "1"),
                   MINDFT_SHRINK_AFTER="3")
    job.start_training()
    lost_at = job.lose("node0", 0)
    codes = {name: job.wait(name) for name in ("node1", "node2")}
    took = time.monotonic() - lost_at
    assert codes == {"node1": 0, "node2": 0}, job.outputs()
    node1 = job.output("node1")
    assert "this standby controller on node 1 takes command of the job (term 1)" in node1, node1[-4000:]
    assert "node 0 lost for good" in node1 and "renumbered 1→0, 2→1" in node1, node1[-4000:]
    events = read(tmp_path / "run-node1")
    resized = [e for e in events if isinstance(e.record, WorldResized)]
    assert [(e.record.members, e.record.lost, e.record.term) for e in resized] == [([1, 2], [0], 2)], events
    (rollback,) = rollbacks(events)
    steps = trained(records)
    assert {world for step, (world, _) in steps.items() if step > rollback} == {2}
    assert_every_sample_used_once(steps)
    reference_out = reference(processes, tmp_path, [(3, rollback), (2, STEPS)], "--api", "model")
    assert_ranks_identical(tmp_path / "out", reference_out, 2)
    assert_nothing_left(hosts)
    print(f"node 0 lost for good: node 1's standby took command and went on with nodes 1 and 2 from step "
          f"{rollback}; both launchers exited 0 {took:.1f} s after the loss")
