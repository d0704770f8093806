"""The headline property: a recovered fault leaves the weights bit-identical to a fault-free run.

Real MindSpore training on CPU (examples/train_mlp.py and examples/train_model.py),
every rank a subprocess, the controller on a thread of the test process, ZeroMQ on
127.0.0.1. Reference weights come from the same examples run with mindft off.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindft.config import Timeouts
from mindft.exitcodes import ExitCode

from harness import (EXAMPLE_ARGS, EXAMPLES, ControllerJob, ExampleReferences, assert_ranks_identical, environment,
                     free_port, job_fixture)

pytestmark = [pytest.mark.mindspore, pytest.mark.timeout(300)]

EXIT_DUMPED = ExitCode.DUMPED
# A silent rank is declared dead after 2 s; generous phase limits for 2 busy cores.
TIMEOUTS = Timeouts(heartbeat_interval=0.1, heartbeat_misses=20, register=60.0, pause=30.0,
                    repair=30.0, rollback=30.0, resume=30.0, connect_retries=10)


@pytest.fixture(scope="module")
def reference(example_references: ExampleReferences) -> Path:
    """Fault-free weights of every (example, world size, rank) used below, mindft off, one process."""
    return example_references.need(*[(example, world) for example, world, _, _ in UCE_JOBS])


class Job(ControllerJob):
    """A controller thread and one subprocess per rank running an example; ``env`` is what every
    rank gets on top of the controller's address (a test may change it before spawning)."""

    def __init__(self, tmp: Path, example: str, world_size: int, secure: bool = False,
                 timeouts: Timeouts = TIMEOUTS) -> None:
        super().__init__(tmp, world_size, timeouts, secure)
        self.example = example
        self.env = dict(GLOG_v="3", PYTHONUNBUFFERED="1", MS_ENABLE_TFT="{UCE:1}", MINDFT_DUMP_DIR=str(tmp / "dump"),
                        MINDFT_REPAIR_TIMEOUT=str(timeouts.repair),
                        MINDFT_SNAPSHOT_EVERY="1")  # the rollback steps asserted below assume it

    def spawn(self, rank: int, *args: str, restart_count: int = 0) -> subprocess.Popen:
        return self.start([str(EXAMPLES / f"{self.example}.py"), *EXAMPLE_ARGS[self.example],
                           "--out", str(self.tmp / "out"), *args],
                          self.rank_environment(rank, restart_count, **self.env),
                          self.tmp / f"rank{rank}.inc{restart_count}.log", stdout=True)

    def spawn_all(self, *args: str) -> list[subprocess.Popen]:
        return [self.spawn(rank, *args) for rank in range(self.world_size)]

    def wait(self, procs: list[subprocess.Popen], timeout: float = 150.0) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank still running after {timeout} s; {self.hung()}")
        return codes


make_job = job_fixture(Job)


def assert_identical(job: Job, reference: Path) -> None:
    assert_ranks_identical(job.tmp / "out", reference / job.example / str(job.world_size), job.world_size)


def assert_recovered(job: Job, recoveries: int = 1) -> None:
    result = job.controller.join(30)
    assert result is not None and result.exit_code == ExitCode.OK, result
    assert len(job.controller.recovery_times) == recoveries


# Each example on 2 ranks, and one rank alone and 4 ranks with train_mlp: a grid of both examples on
# every world size would repeat the same recovery (the rules are the same for any world size:
# tests/unit/flow/).
UCE_JOBS = [("train_mlp", 1, 0, 5), ("train_mlp", 2, 1, 11), ("train_model", 2, 1, 11), ("train_mlp", 4, 2, 6)]


@pytest.mark.parametrize("example, world_size, fault_rank, fault_step", UCE_JOBS,
                         ids=[f"{world}-{rank}-{step}-{example}" for example, world, rank, step in UCE_JOBS])
def test_uce_inside_a_step_is_recovered_bit_identically(make_job, reference: Path, example: str,
                                                        world_size: int, fault_rank: int,
                                                        fault_step: int) -> None:
    job = make_job(example, world_size)
    procs = job.spawn_all("--fault-step", str(fault_step), "--fault-rank", str(fault_rank), "--fault-kind", "uce")
    assert job.wait(procs) == [0] * world_size, job.tail()
    assert_recovered(job)
    faulty_log = job.logs[fault_rank].read_text()
    assert f"fault UCE inside step {fault_step}" in faulty_log
    # The half-done update was undone: back to the newest step every rank held (ranks that keep
    # step with each other only through mindft may be one step apart: the window).
    restored = int(re.search(r"restored step (\d+)", faulty_log).group(1))
    assert fault_step - 2 <= restored <= fault_step - 1
    assert_identical(job, reference)


@pytest.mark.parametrize("example, fault_rank, fault_step", [("train_mlp", 1, 7), ("train_model", 0, 11)])
def test_killed_rank_restarts_from_its_peer_replica_bit_identically(make_job, reference: Path, example: str,
                                                                     fault_rank: int, fault_step: int) -> None:
    job = make_job(example, 2, secure=True)
    args = ("--fault-step", str(fault_step), "--fault-rank", str(fault_rank), "--fault-kind", "exit")
    procs = job.spawn_all(*args)
    victim = procs[fault_rank]
    assert job.wait([victim]) == [137], job.tail()  # died like kill -9, inside the step
    restarted = job.spawn(fault_rank, *args, restart_count=1)
    survivors = [p for p in procs if p is not victim]
    assert job.wait([restarted, *survivors]) == [0, 0], job.tail()
    assert_recovered(job)
    log = job.logs[-1].read_text()
    # The replica is streamed in the background, and a rank reports a step only once its replica
    # arrived: the victim's buddy holds its last capture, or the one before if the victim died
    # before that push was confirmed; every rank holds that step, and they all roll back to it.
    adopted = int(re.search(rf"adopted its replica of step (\d+) from rank {(fault_rank + 1) % 2}", log)[1])
    assert fault_step - 2 <= adopted <= fault_step - 1, log
    others = [path for index, path in enumerate(job.logs) if index != fault_rank]  # survivor and restarted
    assert {int(re.search(r"restored step (\d+)", path.read_text())[1]) for path in others} == {adopted}
    assert_identical(job, reference)


def test_unrecoverable_job_ends_in_dying_gasp_checkpoints(make_job) -> None:
    """Rank 1 dies in step 5 and never comes back: rank 0 dumps the newest step both ranks are
    known to hold, and exits 3. Rank 1 finished step 4, but its report of step 4 may not have
    reached the controller before it died (under load): then that step is 3."""
    import mindspore as ms

    fast = dataclasses.replace(TIMEOUTS, repair=3.0)
    job = make_job("train_mlp", 2, timeouts=fast)
    procs = job.spawn_all("--fault-step", "5", "--fault-rank", "1", "--fault-kind", "exit")
    assert job.wait(procs) == [EXIT_DUMPED, 137], job.tail()
    result = job.controller.join(30)
    assert result is not None and result.exit_code != ExitCode.OK
    assert "rank 1" in result.reason and "repair" in result.reason, result.reason
    dumped = re.search(r"every rank dumps step (\d+)", result.reason)
    assert dumped is not None and int(dumped[1]) in (3, 4), result.reason
    step = int(dumped[1])
    dumps = list((job.tmp / "dump").glob("mindft-rank0-step*.ckpt"))
    assert [d.name for d in dumps] == [f"mindft-rank0-step{step}.ckpt"], job.tail()
    params = ms.load_checkpoint(str(dumps[0]))
    assert {"0.weight", "moment1.0.weight", "global_step"} <= set(params)
    assert int(params["global_step"].asnumpy().reshape(-1)[0]) == step


def test_sparse_snapshots_roll_back_further_and_replay_bit_identically(make_job, reference: Path) -> None:
    """MINDFT_SNAPSHOT_EVERY=3: a fault in step 8 rolls both ranks back to one snapshot step (6, or 3
    when the other rank had not reached step 6 yet: the window lets it lag) and replays from there."""
    job = make_job("train_mlp", 2)
    job.env["MINDFT_SNAPSHOT_EVERY"] = "3"
    procs = job.spawn_all("--fault-step", "8", "--fault-rank", "0")
    assert job.wait(procs) == [0, 0], job.tail()
    assert_recovered(job)
    restored = {re.search(r"restored step (\d+)", log.read_text()).group(1) for log in job.logs}
    assert restored in ({"6"}, {"3"}), restored  # the same snapshot step on both ranks
    assert_identical(job, reference)


def test_a_dump_directory_that_cannot_be_created_is_one_error_line_and_exit_4(make_job) -> None:
    """Rank 1 dies for good; rank 0 must dump, but its dump directory lies below a regular file."""
    fast = dataclasses.replace(TIMEOUTS, repair=3.0)
    job = make_job("train_mlp", 2, timeouts=fast)
    blocker = job.tmp / "not-a-directory"
    blocker.write_text("")
    job.env["MINDFT_DUMP_DIR"] = str(blocker / "dump")
    procs = job.spawn_all("--fault-step", "5", "--fault-rank", "1", "--fault-kind", "exit")
    assert job.wait(procs) == [ExitCode.DUMP_FAILED, 137], job.tail()
    log = job.logs[0].read_text()
    assert "Traceback" not in log, log
    assert f"cannot create directory {blocker / 'dump'}" in log
    assert "dying-gasp checkpoint: NOT written" in log


def _run_example_alone(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    port = free_port()  # where no controller listens
    return subprocess.run([sys.executable, str(EXAMPLES / "train_mlp.py"), "--steps", "3",
                           "--out", str(tmp_path / "out")],
                          env=environment(GLOG_v="3", PYTHONUNBUFFERED="1", MS_ENABLE_TFT="{UCE:1}",
                                          MS_TFT_PORT=str(port), MINDFT_HEARTBEAT_INTERVAL="0.2",
                                          MINDFT_HEARTBEAT_MISSES="5", **env),
                          capture_output=True, text=True, timeout=120)


def test_an_example_run_by_hand_without_a_controller_stops_with_one_clear_error(tmp_path: Path) -> None:
    started = time.monotonic()
    result = _run_example_alone(tmp_path, MINDFT_INSECURE="1")
    assert result.returncode == ExitCode.FAILED, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "no mindft controller answers" in result.stderr and "mindft-launch" in result.stderr
    assert "reconnecting" not in result.stderr  # no stream of retries, one line
    assert time.monotonic() - started < 60


def test_a_rank_started_without_a_key_stops_with_one_clear_error(tmp_path: Path) -> None:
    result = _run_example_alone(tmp_path)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "MINDFT_KEY_FILE is not set" in result.stderr
