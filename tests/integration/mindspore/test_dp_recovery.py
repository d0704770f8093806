"""Data-parallel MindSpore jobs under mindft-launch survive faults and end bit-identical.

examples/train_dp.py as a user runs it: MindSpore's scheduler, MCCL all-reducing the
gradients of every step (``Model.train``, or a hand-written loop with
``DistributedGradReducer``). On CPU a process that left cannot rejoin the running
communicator, and a rank that stops inside a step leaves its peers blocked in the
all-reduce: the ladder's second rung restarts every worker from the node agents' memory
with a new scheduler, and every rank rolls back to the step they all hold. So does the death
of MindSpore's scheduler itself. The jobs that end instead: test_dp_failures.py. How many
ranks or which API makes no difference to the rules (tests/unit/flow/, every world size of the
explorer): these keep what only MindSpore's processes show.
"""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from dp_jobs import api_args, device_plugin, launch, wait_for_status

from harness import Processes, assert_ranks_identical

pytestmark = [pytest.mark.mindspore, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Fault-free final weights per (API, world size), computed once."""
    cache: dict[tuple[str, int], Path] = {}
    tmp = tmp_path_factory.mktemp("dp-reference")

    def reference(api: str, world: int) -> Path:
        if (api, world) not in cache:
            tracker = Processes()
            try:
                code, output = launch(tracker, tmp, f"{api}-{world}", world, *api_args(api))
            finally:
                tracker.kill_all()
            assert code == 0, output.read_text()[-3000:]
            cache[(api, world)] = tmp / f"{api}-{world}" / "out"
        return cache[(api, world)]
    return reference  # type: ignore[return-value]


# Each API once, each way of starting a worker once (the loop API's warm restart of every worker:
# test_two_faults_a_crash_then_a_hot_reset_end_bit_identical).
@pytest.mark.parametrize("api, warm", [pytest.param("model", "1", marks=pytest.mark.compat), ("loop", "0")],
                         ids=["model", "loop-cold-starts"])
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
    # MindSpore's own INFO/WARNING lines stay in the ranks' log files, off the console.
    mindspore_line = re.compile(r"^\[(?:INFO|WARNING)\] [A-Z_]+\(\d+[:,]", re.MULTILINE)
    assert not re.search(r"^\[rank \d+\] \[(?:INFO|WARNING)\] [A-Z_]+\(\d+[:,]", out, re.MULTILINE), out[-4000:]
    logs = "".join(path.read_text(errors="replace") for path in (tmp_path / "run" / "logs").glob("rank_*.log"))
    assert mindspore_line.search(logs), "MindSpore logged nothing to the ranks' log files"
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


@pytest.mark.compat
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


@pytest.mark.compat
def test_two_faults_a_crash_then_a_hot_reset_end_bit_identical(tmp_path: Path, processes: Processes,
                                                                references) -> None:
    launcher, output = launch(processes, tmp_path, "run", 2, "--loop", "--step-seconds", "0.2", "--fault-step", "4",
                              "--fault-rank", "1", "--fault-kind", "exit", wait=False)
    job_file = tmp_path / "run" / "job.json"
    wait_for_status(job_file, launcher, output, lambda s: s.recoveries >= 1 and s.state == "NORMAL" and s.step >= 8,
              "recovery from the crash")
    plugin = device_plugin(job_file, 0, "recovered", tmp_path)
    assert plugin.returncode == 0, plugin.stdout + plugin.stderr
    # The plugin reset the chip only after rank 0's process had left it, then wrote 'recovered'.
    assert "unrecovered" in plugin.stdout and "recovered" in plugin.stdout
    code = launcher.wait(240)
    out = output.read_text()
    assert code == 0, out[-4000:]
    assert "rank 0 DEVICE_RESET" in out and "2 recoveries" in out
    assert_ranks_identical(tmp_path / "run" / "out", references("loop", 2), 2)
    assert processes.leftovers() == []


@pytest.mark.parametrize("api", ["model", pytest.param("loop", marks=pytest.mark.compat)])
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
    wait_for_status(job_file, launcher, output, lambda s: s.state == "NORMAL" and s.step >= 6, "training")
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


