"""Data-parallel MindSpore jobs under mindft-launch that end: a failed device, a bug in the training
script (not a device fault: not retried), a callback that cannot rewind, the node agent killed.
Every rank leaves a dying gasp of one step, and no process outlives the job. The jobs that
recover: test_dp_recovery.py.
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from dp_jobs import api_args, device_plugin, dumped_steps, launch, wait_for_status

from harness import Processes
from mindft.exitcodes import ExitCode

pytestmark = [pytest.mark.mindspore, pytest.mark.timeout(600)]


@pytest.mark.compat
def test_a_failed_device_leaves_same_step_dying_gasps_and_exit_3(tmp_path: Path, processes: Processes) -> None:
    launcher, output = launch(processes, tmp_path, "run", 2, "--step-seconds", "0.2", wait=False)
    job_file = tmp_path / "run" / "job.json"
    wait_for_status(job_file, launcher, output, lambda s: s.state == "NORMAL" and s.step >= 6, "training")
    plugin = device_plugin(job_file, 1, "failed", tmp_path)
    assert plugin.returncode == 0, plugin.stdout + plugin.stderr
    code = launcher.wait(240)
    out = output.read_text()
    assert code == ExitCode.DUMPED, out[-4000:]
    dumps = sorted((tmp_path / "run" / "dump").rglob("*.ckpt"))
    assert len(dumps) == 2, dumps
    steps = set()
    for path in dumps:
        checkpoint = ms.load_checkpoint(str(path))
        steps.add(int(np.asarray(checkpoint["global_step"].asnumpy()).reshape(-1)[0]))
    assert len(steps) == 1, f"dying gasps of different steps: {steps}"
    assert f"every rank dumps step {steps.pop()}" in out
    assert processes.leftovers() == []


@pytest.mark.parametrize("api", ["model", "loop"])
def test_a_bug_in_the_training_script_ends_the_job_at_once(api: str, tmp_path: Path, processes: Processes) -> None:
    code, output = launch(processes, tmp_path, "run", 2, *api_args(api), "--fault-step", "9", "--fault-rank", "1",
                          "--fault-kind", "bug")
    out = output.read_text()
    assert code == ExitCode.FAILED, out[-4000:]
    assert "rank=1: the training script raised an exception in step 9, not a device fault" in out, out[-4000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-6000:]  # said once, with its traceback
    assert "rank 1 raised an exception from the training script in step 9" in out
    assert "restarting" not in out and "incarnation 1" not in out  # not retried
    steps = dumped_steps(tmp_path / "run")
    assert len(steps) == 2 and len(set(steps)) == 1, steps  # every rank's dying gasp, of one step
    assert processes.leftovers() == []


def test_rewind_required_after_a_restart_exits_7_with_one_line(tmp_path: Path, processes: Processes) -> None:
    # model.train with the callback cannot go back to the step a restarted process restores.
    code, output = launch(processes, tmp_path, "run", 2, "--callback", "--fault-step", "9", "--fault-rank", "1",
                          "--fault-kind", "kill")
    out = output.read_text()
    assert code == ExitCode.REWIND_REQUIRED, out[-4000:]
    assert out.count("restarting every worker from the node agents' memory") == 1, out[-4000:]
    assert re.search(r"mindft: rank \d: rolled back to step \d+: re-enter training at batch", out), out[-4000:]
    assert "Traceback" not in out and "not restarting rank" in out
    assert processes.leftovers() == []


@pytest.mark.parametrize("warm", ["1", "0"], ids=["warm-starts", "cold-starts"])
def test_the_node_agent_killed_leaves_same_step_dying_gasps_and_no_process(warm: str, tmp_path: Path,
                                                                          processes: Processes) -> None:
    """SIGKILL of mindft-launch (node 0's agent, with the controller in it): every rank writes its
    dying gasp of one step from its own memory, and nothing of the job outlives the agent."""
    launcher, output = launch(processes, tmp_path, "run", 2, "--step-seconds", "0.2", wait=False,
                              MINDFT_WARM_START=warm)
    job_file = tmp_path / "run" / "job.json"
    wait_for_status(job_file, launcher, output, lambda s: s.state == "NORMAL" and s.step >= 6, "training")
    processes.remember(launcher.pid)
    assert len(processes.seen) >= 3  # MindSpore's scheduler, two ranks (the warm process and its waiters)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60
    while processes.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    # The agent's shared memory outlives it here (a pod's /dev/shm goes with the pod): once the
    # ranks are gone, nothing needs it.
    memory = re.search(r"the ranks' snapshots live in (\S+) \(shared memory", output.read_text())
    assert memory, output.read_text()[-3000:]
    shutil.rmtree(memory[1], ignore_errors=True)
    assert processes.leftovers() == []
    # (their output went to the agent's pipes: the dying gasps are what they leave)
    steps = dumped_steps(tmp_path / "run")
    assert len(steps) == 2 and len(set(steps)) == 1 and steps[0] >= 6, steps
