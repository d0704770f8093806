"""mindft's rollback driven by MindIO TFT's real controller and processors (no mocks), on 127.0.0.1.

Each job is a controller process plus 2 or 4 rank processes of tests/mindio_rank.py.
The MindIO wheel is required: without it these tests skip locally and FAIL when CI is set.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest

from mindft.exitcodes import ExitCode

import mindio_rank  # the helper script doubles as the job's definition
from harness import MINDIO_RANK, TESTS, free_port, job_fixture, require

pytestmark = pytest.mark.slow

STEPS = 12
JOB_TIMEOUT = 120.0  # start (mindspore import) + a recovery or a dump; generous for 2 loaded cores


def require_mindio() -> None:
    require("mindio_ttp", "the mindio_ttp wheel is not installed (pip install ../shared/wheels/mindio_ttp-*.whl)")


class Job:
    """A MindIO controller and ``world_size`` ranks; :meth:`cleanup` kills whatever is left."""

    def __init__(self, tmp: Path, world_size: int) -> None:
        require_mindio()
        self.tmp, self.world_size = tmp, world_size
        self.port = free_port()
        self.hub, self._close_hub = mindio_rank.serve_hub(world_size, self._destroy_controller)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
                    "TTP_LOG_LEVEL": os.environ.get("TTP_LOG_LEVEL", "WARNING")}
        self.controller: Optional[subprocess.Popen] = None
        self.ranks: Dict[int, subprocess.Popen] = {}

    def start(self, faults: Optional[Dict[int, str]] = None) -> None:
        # MindIO logs to stdout too (TTP_LOG_STDOUT=1): into a file, never an unread pipe.
        self.controller = subprocess.Popen(
            [sys.executable, str(MINDIO_RANK), "controller", str(self.world_size), str(self.port)],
            stdin=subprocess.PIPE, stdout=open(self.tmp / "controller.out", "w"),
            stderr=open(self.tmp / "controller.err", "w"), env=self.env)
        deadline = time.monotonic() + JOB_TIMEOUT
        while "ready\n" not in (self.tmp / "controller.out").read_text():
            if self.controller.poll() is not None:
                pytest.fail(f"MindIO controller exited before it was ready:\n{self.log('controller.err')}")
            assert time.monotonic() < deadline, "MindIO controller did not start"
            time.sleep(0.05)
        for rank in range(self.world_size):
            fault = (faults or {}).get(rank)
            command = [sys.executable, str(MINDIO_RANK), "rank", str(rank), str(self.world_size),
                       str(self.port), self.hub, str(STEPS), str(self.tmp / f"rank{rank}.npz")]
            if fault:
                command += ["--fault", fault]
            self.ranks[rank] = subprocess.Popen(command, stdout=open(self.tmp / f"rank{rank}.out", "w"),
                                                stderr=open(self.tmp / f"rank{rank}.err", "w"), env=self.env)

    def wait(self, timeout: float = JOB_TIMEOUT) -> Dict[int, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for rank, process in self.ranks.items():
            try:
                codes[rank] = process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still running after {timeout} s:\n{self.log(f'rank{rank}.err')}")
        return codes

    def stop_controller(self, timeout: float = 30.0) -> int:
        assert self.controller is not None
        self.controller.stdin.close()
        return self.controller.wait(timeout)

    def _destroy_controller(self) -> None:
        """Every rank finished: the controller goes before their processors (the hub's gate waits)."""
        if self.controller is not None:
            self.stop_controller()

    def events(self, rank: int) -> List[dict]:
        lines = (self.tmp / f"rank{rank}.out").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def log(self, name: str) -> str:
        path = self.tmp / name
        return path.read_text()[-4000:] if path.exists() else ""

    def final_state(self, rank: int) -> Dict[str, np.ndarray]:
        with np.load(self.tmp / f"rank{rank}.npz") as data:
            return {name: data[name] for name in data.files}

    def cleanup(self) -> None:
        for process in [*self.ranks.values(), self.controller]:
            if process is not None and process.poll() is None:
                process.kill()  # SIGKILL: MindIO processors ignore SIGTERM by design
                process.wait(10)
        self._close_hub()


make_job = job_fixture(Job)


def assert_bit_identical(job: Job) -> None:
    expected = mindio_rank.expected_state(STEPS)
    for rank in range(job.world_size):
        state = job.final_state(rank)
        for name, array in expected.items():
            assert state[name].tobytes() == array.tobytes(), f"rank {rank}: {name} differs from a fault-free run"


@pytest.mark.parametrize("world_size", [2, 4])
def test_uce_on_one_rank_rolls_every_rank_back_through_mindio(make_job, world_size: int) -> None:
    faulty = world_size - 1
    job = make_job(world_size)
    job.start(faults={faulty: "uce:5"})
    assert job.wait() == {rank: 0 for rank in range(world_size)}, job.log(f"rank{faulty}.err")
    assert_bit_identical(job)
    repair_steps = set()
    for rank in range(world_size):
        events = job.events(rank)
        restored = [event for event in events if event["event"] == "restored"]
        resumed = [event for event in events if event["event"] == "resumed"]
        assert len(resumed) == 1, events
        assert restored and all(event["step"] == resumed[0]["step"] - 1 for event in restored), events
        repair_steps.add(resumed[0]["step"] - 1)
        sources = [event["source"] for event in restored if event["source"] is not None]
        # Only the faulty rank copies the repair step's state from a healthy replica.
        assert sources == ([] if rank != faulty else [sources[0]]) and faulty not in sources
    assert len(repair_steps) == 1, repair_steps  # MindIO chose one step for every rank
    for rank in range(world_size):  # as in a run without a fault: the wheel's SIG_IGN-alike undone, closed
        events = job.events(rank)
        assert events[0] == {**events[0], "event": "started", "sigterm": True}
        assert events[-1]["event"] == "closed"
    assert job.stop_controller() == 0


def test_killed_rank_makes_mindio_dump_and_every_rank_exit(make_job) -> None:
    job = make_job(2)
    job.start(faults={1: "kill:4"})
    codes = job.wait()
    assert codes[1] == -signal.SIGKILL
    # MindIO cannot restart a killed rank without MindCluster: the live replica dumps, then all exit.
    assert codes[0] == ExitCode.DUMPED, job.log("rank0.err")
    dumped = [event for event in job.events(0) if event["event"] == "dumped"]
    assert len(dumped) == 1
    manifest = json.loads(Path(dumped[0]["path"]).with_suffix(".json").read_text())
    assert manifest["step"] >= 3 and manifest["rank"] == 0
    expected = mindio_rank.expected_state(manifest["step"])
    assert Path(dumped[0]["path"]).stat().st_size > expected["w"].nbytes
    assert job.events(0)[-1]["event"] == "exit"
    assert job.stop_controller() == 0  # bounded even though MindIO's controller already went to EXIT


def test_ranks_close_without_hanging_when_the_controller_is_gone(make_job) -> None:
    job = make_job(2)
    job.start()
    assert job.wait() == {0: 0, 1: 0}
    # The ranks closed their processors while the controller was alive; now the opposite order.
    job2 = make_job(2)
    job2.start()
    deadline = time.monotonic() + JOB_TIMEOUT
    while not any(event["event"] == "running" for event in _events_or_empty(job2, 0)):
        assert time.monotonic() < deadline, job2.log("rank0.err")
        time.sleep(0.2)
    job2.controller.kill()
    job2.controller.wait(10)
    codes = job2.wait(timeout=JOB_TIMEOUT)
    # With its controller gone MindIO cannot coordinate anything: every rank must still end, bounded.
    assert set(codes) == {0, 1}
    for rank, code in codes.items():
        assert code in (0, ExitCode.FAILED, ExitCode.DUMPED), (rank, code, job2.log(f"rank{rank}.err"))


def test_a_rank_that_abandons_the_wheels_destroy_still_exits_with_its_own_status(make_job) -> None:
    # Exiting with the destroy still blocked in the wheel used to abort in its C++ teardown
    # ("terminate called without an active exception", -6) every time the destroy was abandoned.
    job = make_job(2)
    job.env["MINDIO_TEST_CLOSE_TIMEOUT"] = "0.01"
    job.start()
    assert job.wait() == {0: 0, 1: 0}, job.log("rank0.err")
    for rank in range(2):
        assert [e["clean"] for e in job.events(rank) if e["event"] == "closed"] == [False]
    assert_bit_identical(job)


def _events_or_empty(job: Job, rank: int) -> List[dict]:
    try:
        return job.events(rank)
    except (FileNotFoundError, json.JSONDecodeError):
        return []
