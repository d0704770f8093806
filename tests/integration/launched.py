"""Jobs run by mindft-launch (or msrun) as a user runs them: the helpers the cluster tests share."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

import numpy as np
import psutil
import pytest

from mindft import launch_plan
from mindft.controller import Controller

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 300.0  # one 2-rank MindSpore job; ~15-25 s on 2 busy cores
LAUNCH_VARIABLES = ("MINDFT_NPROC", "MINDFT_NNODES", "MINDFT_NODE_RANK", "VC_TASK_INDEX", "MINDFT_MASTER_ADDR",
                    "MINDFT_MASTER_PORT", "MINDFT_SCHEDULER", "MINDFT_KEY_FILE", "MINDFT_INSECURE", "MS_TFT_PORT")


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the scheduler and the controller), as mindft-launch picks them."""
    return launch_plan.free_port_pair("127.0.0.1")


class Processes:
    """Every command a test starts; the whole process tree of each is killed at the end."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.seen: dict[int, psutil.Process] = {}

    def run(self, argv: list[str], env: dict[str, str], output: Path,
            timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
        with open(output, "wb") as out:
            process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                       start_new_session=True)
        self.started.append(process)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            self._remember(process.pid)
            time.sleep(0.2)
        if process.poll() is None:
            self.kill_all()
            pytest.fail(f"{argv[2]} did not finish in {timeout}s:\n{output.read_text(errors='replace')[-4000:]}")
        return process.returncode, output.read_text(errors="replace")

    def _remember(self, pid: int) -> None:
        # Ranks and schedulers start sessions of their own: only the tree finds them all.
        try:
            for child in psutil.Process(pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def leftovers(self) -> list[str]:
        """The command lines of processes seen during the run that are still alive."""
        alive = []
        for process in self.seen.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(process.cmdline()[:3]))
            except psutil.NoSuchProcess:
                pass
        return alive

    def kill_all(self) -> None:
        for process in self.started:
            self._remember(process.pid)
        for process in [*self.seen.values(), *(psutil.Process(p.pid) for p in self.started if p.poll() is None)]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        for process in self.started:
            if process.poll() is None:
                process.wait(10)


def end_job(procs: Iterable[subprocess.Popen], controller: Controller) -> None:
    """Kill a hand-made job's rank processes that still run and stop its controller."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot die otherwise
            except ProcessLookupError:
                pass
            proc.kill()
        proc.wait(10)
    controller.stop()


def environment(tmp_path: Path, **changes: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in (*LAUNCH_VARIABLES, "MS_ENABLE_TFT", "MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MINDFT_RESET_FILE"] = str(tmp_path / "reset.json")
    env.update(changes)
    return env


def weights(directory: Path, rank: int) -> dict[str, np.ndarray]:
    with np.load(directory / f"rank{rank}.npz") as data:
        return {name: data[name] for name in data.files}


def assert_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert sorted(a) == sorted(b), what
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), f"{what}: {name} differs"
