"""Data-parallel MindSpore jobs under mindft-launch survive faults and end bit-identical.

examples/train_dp.py as a user runs it: MindSpore's scheduler, MCCL all-reducing the
gradients of every step (``Model.train``, or a hand-written loop with
``DistributedGradReducer``). On CPU a process that left cannot rejoin the running
communicator, and a rank that stops inside a step leaves its peers blocked in the
all-reduce: the ladder's second rung restarts every worker from the node agents' memory
with a new scheduler, and every rank rolls back to the step they all hold. So does the death
of MindSpore's scheduler itself.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from harness import ROOT, Processes, assert_ranks_identical, environment, free_port_pair
from mindft.net.channel import Client, ControllerUnreachable
from mindft.exitcodes import ExitCode
from mindft.net.keys import load_keys

pytestmark = [pytest.mark.mindspore, pytest.mark.timeout(600)]

DP_SCRIPT = ROOT / "examples" / "train_dp.py"
EPOCHS = 2  # 256 samples, batch 8 per rank: 32 steps on 2 ranks, 16 on 4
FAST_FAULTS = {"MINDFT_HEARTBEAT_INTERVAL": "0.1", "MINDFT_HEARTBEAT_MISSES": "20", "MINDFT_STALL_TIMEOUT": "2",
               "MINDFT_RESET_POLL_INTERVAL": "0.1",
               "MINDFT_SNAPSHOT_EVERY": "1"}  # the rollback steps asserted below assume a snapshot every step


def launch(processes: Processes, tmp: Path, name: str, world: int, *script_args: str,
           wait: bool = True, **env: str) -> tuple[subprocess.Popen, Path]:
    """mindft-launch with msrun's flags on one node; returns the launcher and its output file."""
    port = free_port_pair()
    run_dir = tmp / name
    argv = [sys.executable, "-m", "mindft.cli.launch", "--worker_num", str(world), "--local_worker_num", str(world),
            "--master_port", str(port), "--run-dir", str(run_dir), "--cluster_time_out", "120",
            str(DP_SCRIPT), "--epochs", str(EPOCHS), "--out", str(run_dir / "out"), *script_args]
    environ = environment(tmp, **{"MS_ENABLE_TFT": "{RSC:1}", "MINDFT_DUMP_DIR": str(run_dir / "dump"),
                                  "MINDFT_RESET_FILE": str(run_dir / "reset.json"), **FAST_FAULTS, **env})
    output = tmp / f"{name}.out"
    if wait:
        code, _ = processes.run(argv, environ, output)
        return code, output  # type: ignore[return-value]
    return processes.start(argv, environ, output), output


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Fault-free final weights per (API, world size), computed once."""
    cache: dict[tuple[str, int], Path] = {}
    tmp = tmp_path_factory.mktemp("dp-reference")

    def reference(api: str, world: int) -> Path:
        if (api, world) not in cache:
            tracker = Processes()
            try:
                code, output = launch(tracker, tmp, f"{api}-{world}", world, *(["--loop"] if api == "loop" else []))
            finally:
                tracker.kill_all()
            assert code == 0, output.read_text()[-3000:]
            cache[(api, world)] = tmp / f"{api}-{world}" / "out"
        return cache[(api, world)]
    return reference  # type: ignore[return-value]


def api_args(api: str) -> list[str]:
    return ["--loop"] if api == "loop" else []


@pytest.mark.parametrize("api, warm", [("model", "1"), ("loop", "1"), ("loop", "0")],
                         ids=["model", "loop", "loop-cold-starts"])
def test_a_rank_killed_mid_step_restarts_every_worker_from_memory(api: str, warm: str, tmp_path: Path,
                                                                   processes: Processes, references) -> None:
    code, output = launch(processes, tmp_path, "run", 2, *api_args(api), "--fault-step", "12", "--fault-rank", "1",
                          "--fault-kind", "kill", MINDFT_WARM_START=warm)
    out = output.read_text()
    assert code == 0, out[-4000:]
    # Every worker, the first time and after the fault, and both schedulers: forked, or all cold.
    if warm == "1":
        assert out.count(", warm), log") == 4 and "warm start: 6 process(es) forked from pid" in out, out[-4000:]
    else:
        assert out.count(", cold), log") == 4 and "warm start:" not in out, out[-4000:]
    assert "rank 1 (pid" in out and "killed by SIGKILL" in out
    assert "restarting every worker from the node agents' memory" in out
    assert "started MindSpore's scheduler" in out and out.count("started MindSpore's scheduler") == 2
    # The restarted processes found their snapshots in the agent's memory: both hold step 11,
    # or 10 when rank 1 died while its capture of step 11 was still copying (overlapped with
    # step 12, which no longer waits for the peers at its start but before its all-reduce).
    assert re.search(r"every rank holds step 1[01]\b", out), out[-4000:]
    assert "the node agent held" in out and "for 2 rank(s)" in out  # reported, then freed
    assert_ranks_identical(tmp_path / "run" / "out", references(api, 2), 2)
    assert processes.leftovers() == []


@pytest.mark.parametrize("api", ["model", "loop"])
def test_a_uce_before_the_all_reduce_restarts_every_worker_after_the_stall(api: str, tmp_path: Path,
                                                                             processes: Processes, references) -> None:
    code, output = launch(processes, tmp_path, "run", 2, *api_args(api), "--fault-step", "9", "--fault-rank", "0",
                          "--fault-kind", "uce")
    out = output.read_text()
    assert code == 0, out[-4000:]
    # Rank 1 has finished step 8 when rank 0 faults in step 9: it captures step 8 even when
    # the PAUSE is already waiting, so step 8 is held by every rank.
    assert "rank 0 UCE in step 9" in out and "every rank holds step 8" in out, out[-4000:]
    assert "every rank holds step 7" not in out, out[-4000:]
    if "did not pause within 2 s (timeouts.stall)" in out:
        # Rank 1 passed its lockstep gate and waits in step 9's all-reduce for rank 0: it never
        # pauses, every worker restarts, no MCCL timeout is waited for.
        assert "restarting every worker" in out
    else:
        # The PAUSE reached rank 1 in time: at its gate before step 9's all-reduce (it abandoned
        # step 9 there), or at the end of step 8 before it began step 9. Either way every rank
        # rolled back in place, no worker restarted.
        assert "every live rank paused" in out and "restarting every worker" not in out, out[-4000:]
    assert_ranks_identical(tmp_path / "run" / "out", references(api, 2), 2)


def test_mindspores_own_callback_under_ttp_restarts_a_killed_rank_from_memory(tmp_path: Path, processes: Processes,
                                                                              references) -> None:
    # Model.train(callbacks=[TrainFaultTolerance(...)]), the optimizer wrapped for it, as MindSpore's
    # docs show; on CPU MindSpore itself refuses it ("MindIO adapter only support on Ascend").
    code, output = launch(processes, tmp_path, "run", 2, "--mindspore-tft", "--fault-step", "12", "--fault-rank",
                          "1", "--fault-kind", "kill", MS_ENABLE_TFT="{TTP:1}")
    out = output.read_text()
    assert code == 0, out[-4000:]
    assert "serves MindSpore's TrainFaultTolerance on mindft" in out and "restarting every worker" in out
    assert_ranks_identical(tmp_path / "run" / "out", references("model", 2), 2)
    assert processes.leftovers() == []


def test_a_stopped_rank_is_a_hang_and_every_worker_restarts(tmp_path: Path, processes: Processes,
                                                            references) -> None:
    code, output = launch(processes, tmp_path, "run", 2, "--fault-step", "7", "--fault-rank", "1",
                          "--fault-kind", "stop")
    out = output.read_text()
    assert code == 0, out[-4000:]
    assert "HANG" in out and "restarting every worker" in out
    assert_ranks_identical(tmp_path / "run" / "out", references("model", 2), 2)
    assert processes.leftovers() == []


def test_four_ranks_recover_a_killed_rank_bit_identically(tmp_path: Path, processes: Processes, references) -> None:
    code, output = launch(processes, tmp_path, "run", 4, "--fault-step", "6", "--fault-rank", "2",
                          "--fault-kind", "exit")
    out = output.read_text()
    assert code == 0, out[-4000:]
    # Step 5, or 4 when rank 2 exited while its capture of step 5 was still copying (overlapped
    # with step 6, which waits for its peers only before its all-reduce).
    assert re.search(r"every rank holds step [45]\b", out), out[-4000:]
    assert_ranks_identical(tmp_path / "run" / "out", references("model", 4), 4)


def _status(job_file: Path):
    info = json.loads(job_file.read_text())
    keys = None if info["insecure"] else load_keys(Path(info["key_file"]))
    return Client(info["controller"], keys, timeout=2.0).status()


def _wait_for(job_file: Path, launcher: subprocess.Popen, output: Path, ready, what: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, f"the job ended before {what}:\n{output.read_text()[-4000:]}"
        if job_file.exists():
            try:
                status = _status(job_file)
            except ControllerUnreachable:
                status = None
            if status is not None and ready(status):
                return status
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout} s:\n{output.read_text()[-4000:]}")


def _plugin(job_file: Path, rank: int, outcome: str, tmp: Path) -> subprocess.CompletedProcess:
    """The device plugin's hot reset of ``rank``'s chip, as `mindft simulate-device-plugin` plays it."""
    return subprocess.run([sys.executable, "-m", "mindft.cli.main", "simulate-device-plugin", "--job", str(job_file),
                           "--rank", str(rank), "--hold", "1", "--outcome", outcome, "--process-deadline", "30"],
                          env=environment(tmp), capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_two_faults_a_crash_then_a_hot_reset_end_bit_identical(tmp_path: Path, processes: Processes,
                                                                references) -> None:
    launcher, output = launch(processes, tmp_path, "run", 2, "--loop", "--step-seconds", "0.2", "--fault-step", "4",
                              "--fault-rank", "1", "--fault-kind", "exit", wait=False)
    job_file = tmp_path / "run" / "job.json"
    _wait_for(job_file, launcher, output, lambda s: s.recoveries >= 1 and s.state == "NORMAL" and s.step >= 8,
              "recovery from the crash")
    plugin = _plugin(job_file, 0, "recovered", tmp_path)
    assert plugin.returncode == 0, plugin.stdout + plugin.stderr
    # The plugin reset the chip only after rank 0's process had left it, then wrote 'recovered'.
    assert "unrecovered" in plugin.stdout and "recovered" in plugin.stdout
    code = launcher.wait(240)
    out = output.read_text()
    assert code == 0, out[-4000:]
    assert "rank 0 DEVICE_RESET" in out and "2 recoveries" in out
    assert_ranks_identical(tmp_path / "run" / "out", references("loop", 2), 2)
    assert processes.leftovers() == []


def test_a_failed_device_leaves_same_step_dying_gasps_and_exit_3(tmp_path: Path, processes: Processes) -> None:
    launcher, output = launch(processes, tmp_path, "run", 2, "--step-seconds", "0.2", wait=False)
    job_file = tmp_path / "run" / "job.json"
    _wait_for(job_file, launcher, output, lambda s: s.state == "NORMAL" and s.step >= 6, "training")
    plugin = _plugin(job_file, 1, "failed", tmp_path)
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
def test_a_uce_after_the_all_reduce_rolls_back_in_place(api: str, tmp_path: Path, processes: Processes,
                                                        references) -> None:
    """The cheapest rung: every rank finished the step's collectives; mindft holds each rank at the
    step's end until all finished it, so every peer pauses there and no process restarts."""
    code, output = launch(processes, tmp_path, "run", 2, *api_args(api), "--fault-step", "9", "--fault-rank", "1",
                          "--fault-kind", "uce-after")
    out = output.read_text()
    assert code == 0, out[-4000:]
    assert "rank 1 UCE in step" in out and "every live rank paused" in out
    assert "restarting every worker" not in out and "restart 1/" not in out
    assert_ranks_identical(tmp_path / "run" / "out", references(api, 2), 2)


def test_a_killed_scheduler_restarts_every_worker_behind_a_new_one(tmp_path: Path, processes: Processes,
                                                                   references) -> None:
    """MindSpore's scheduler is a member of the job: SIGKILLed mid-training, every worker restarts
    from the node agents' memory behind a new scheduler, and the job ends bit-identical."""
    launcher, output = launch(processes, tmp_path, "run", 2, "--step-seconds", "0.2", wait=False)
    job_file = tmp_path / "run" / "job.json"
    _wait_for(job_file, launcher, output, lambda s: s.state == "NORMAL" and s.step >= 6, "training")
    processes.remember(launcher.pid)
    old = json.loads(job_file.read_text())["scheduler_pid"]
    os.kill(old, signal.SIGKILL)
    code = launcher.wait(240)
    out = output.read_text()
    assert code == 0, out[-4000:]
    # The launcher names the cause and the restart, and that a new scheduler serves the new workers.
    assert f"MindSpore's scheduler (pid {old}) killed by SIGKILL" in out, out[-4000:]
    assert "every worker restarts behind a new scheduler (restart 1/3)" in out
    assert re.search(r"SCHEDULER_LOST in step \d+ \(MindSpore's scheduler, pid \d+, killed by SIGKILL\); "
                     r"restarting every worker from the node agents' memory", out), out[-4000:]
    assert "a new MindSpore scheduler (pid" in out and "job failed" not in out
    assert (tmp_path / "run" / "logs" / "scheduler.0.log").is_file()  # the lost one's log, kept
    assert_ranks_identical(tmp_path / "run" / "out", references("model", 2), 2)
    assert processes.leftovers() == []


# ---- deterministic failures end the job: a bug is not a device fault ----

def _dumped_steps(run_dir: Path) -> list[int]:
    """The step of every dying-gasp checkpoint written for the job."""
    steps = []
    for path in sorted((run_dir / "dump").rglob("*.ckpt")):
        checkpoint = ms.load_checkpoint(str(path))
        steps.append(int(np.asarray(checkpoint["global_step"].asnumpy()).reshape(-1)[0]))
    return steps


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
    steps = _dumped_steps(tmp_path / "run")
    assert len(steps) == 2 and len(set(steps)) == 1, steps  # every rank's dying gasp, of one step
    assert processes.leftovers() == []


def test_a_rank_that_dies_in_the_same_step_again_ends_the_job_after_one_retry(tmp_path: Path,
                                                                              processes: Processes) -> None:
    code, output = launch(processes, tmp_path, "run", 2, "--fault-step", "9", "--fault-rank", "1",
                          "--fault-kind", "exit-always")
    out = output.read_text()
    assert code == ExitCode.FAILED, out[-4000:]
    assert out.count("restarting every worker from the node agents' memory") == 1, out[-4000:]
    # (the step after the last one reported: 8 when step 8's report died with the process)
    assert re.search(r"rank 1 PROCESS_DIED in step [89] again after the job recovered from it", out), out[-4000:]
    steps = _dumped_steps(tmp_path / "run")
    assert len(steps) == 2 and len(set(steps)) == 1, steps
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
    _wait_for(job_file, launcher, output, lambda s: s.state == "NORMAL" and s.step >= 6, "training")
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
    steps = _dumped_steps(tmp_path / "run")
    assert len(steps) == 2 and len(set(steps)) == 1 and steps[0] >= 6, steps
