"""One mindft-launch job of fake ranks, for the tests that need a live launcher: the ``launch``
fixture (registered by tests/conftest.py) starts jobs and kills what is left of them afterwards."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from mindft.net.channel import Client, ControllerUnreachable
from mindft.net.keys import load_keys

import fake_rank  # the rank script doubles as the reference implementation
from harness import FAKE_RANK

RANK_SCRIPT = FAKE_RANK
DEADLINE = 90.0  # seconds a launched job gets to reach what a test waits for


class Job:
    """One mindft-launch process and everything it was given."""

    def __init__(self, tmp: Path, nproc: int, steps: int, step_time: float, extra_args: tuple[str, ...],
                 env: dict[str, str], script: Path = RANK_SCRIPT) -> None:
        self.tmp, self.steps, self.nproc = tmp, steps, nproc
        self.run_dir = tmp / "run"
        self.reset_file = tmp / "reset" / "reset.json"
        self.output = tmp / "launcher.out"
        full_env = dict(os.environ)
        full_env.update({
            "LAUNCH_DIR": str(tmp), "LAUNCH_STEPS": str(steps), "LAUNCH_STEP_TIME": str(step_time),
            "MINDFT_HEARTBEAT_INTERVAL": "0.1", "MINDFT_HEARTBEAT_MISSES": "10",
            "MINDFT_RESET_POLL_INTERVAL": "0.05", "MINDFT_RESET_FILE": str(self.reset_file),
            "MINDFT_DUMP_DIR": str(tmp / "dump"), "MINDFT_REGISTER_TIMEOUT": "60",
            "MINDFT_REPAIR_TIMEOUT": "30", "MS_ENABLE_TFT": "{RSC:1}",
        })
        full_env.pop("MINDFT_KEY_FILE", None)
        full_env.update(env)
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mindft.cli.launch", "--nproc", str(nproc), "--run-dir", str(self.run_dir),
                 *extra_args, str(script)],
                env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait(self, timeout: float = DEADLINE) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"mindft-launch did not finish in {timeout}s; output:\n{self.text()[-4000:]}")

    def job_info(self) -> dict:
        return json.loads((self.run_dir / "job.json").read_text())

    def client(self) -> Client:
        info = self.job_info()
        return Client(info["controller"], load_keys(Path(info["key_file"])), timeout=2.0)

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"launcher exited ({self.process.returncode}) while waiting for {what}:\n"
                            f"{self.text()[-4000:]}")
            try:
                if condition():
                    return
            except (OSError, ValueError, KeyError, ControllerUnreachable):
                pass
            time.sleep(0.05)
        pytest.fail(f"timed out waiting for {what}; output:\n{self.text()[-4000:]}")

    def committed(self) -> int:
        return self.client().status().step

    def rank_pids(self) -> list[int]:
        try:
            return [int(pid) for pid in self.job_info()["ranks"].values()]
        except (OSError, ValueError):
            return []

    def assert_bit_identical(self) -> None:
        for rank in range(self.nproc):
            final = np.load(self.tmp / f"final-{rank}.npy")
            assert final.tobytes() == fake_rank.reference(rank, self.steps).tobytes(), f"rank {rank} differs"

    def kill(self) -> None:
        pids = self.rank_pids()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(nproc: int = 2, steps: int = 30, step_time: float = 0.02, args: tuple[str, ...] = (),
              script: Path = RANK_SCRIPT, **env: str) -> Job:
        job = Job(tmp_path, nproc, steps, step_time, args, env, script)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill()
