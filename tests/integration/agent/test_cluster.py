"""mindft-launch runs MindSpore's cluster as msrun does.

The same tutorial-style data-parallel script (examples/train_dp.py: ``init()``,
``DATA_PARALLEL``, a sharded data set, ``Model.train`` through mindft's one line) runs
under msrun and under mindft-launch with msrun's own flags, and ends bit-identical. That the
msrun flag names mean what mindft's own names mean: tests/unit/agent/test_msrun_flags.py.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from harness import FAKE_RANK, ROOT, Processes, assert_identical, environment, free_port_pair, weights

DP_SCRIPT = ROOT / "examples" / "train_dp.py"
PLAIN_SCRIPT = FAKE_RANK


@pytest.mark.mindspore
def test_dp_script_under_msrun_and_mindft_launch_ends_bit_identical(tmp_path: Path, processes: Processes) -> None:
    """Same flags, only the command name changes; MCCL all-reduces the gradients in both."""
    runs: dict[str, tuple[int, str]] = {}
    for command, env in (("msrun", environment(tmp_path)),
                         ("mindft-launch", environment(tmp_path, MS_ENABLE_TFT="{RSC:1}"))):
        port = free_port_pair()
        flags = ["--worker_num", "2", "--local_worker_num", "2", "--master_addr", "127.0.0.1",
                 "--master_port", str(port), "--log_dir", str(tmp_path / f"{command}-logs"), "--join", "True",
                 "--cluster_time_out", "120"]
        module = "mindspore.parallel.cluster.run" if command == "msrun" else "mindft.cli.launch"
        code, out = processes.run([sys.executable, "-m", module, *flags, str(DP_SCRIPT),
                                   "--out", str(tmp_path / f"{command}-out")], env, tmp_path / f"{command}.out")
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / f"{command}-logs").glob("*.log"))
        assert code == 0, f"{command} failed ({code}):\n{out[-3000:]}\n{logs}"
        runs[command] = code, out

    launched = runs["mindft-launch"][1]
    assert f"MindSpore scheduler 127.0.0.1:{port}" in launched and f"controller tcp://127.0.0.1:{port + 1}" in launched
    assert "all 2 ranks finished at step 32" in launched  # protected: registered, reported every step
    assert "after the job ended" not in launched  # the scheduler finished by itself once the ranks left
    assert (tmp_path / "mindft-launch-logs" / "scheduler.log").is_file()
    for rank in (0, 1):
        assert_identical(weights(tmp_path / "msrun-out", rank), weights(tmp_path / "mindft-launch-out", rank),
                          f"rank {rank}: msrun vs mindft-launch")
    # Each rank trained on its own shard: equal replicas mean the gradients really were all-reduced.
    ours = weights(tmp_path / "mindft-launch-out", 0)
    assert_identical(ours, weights(tmp_path / "mindft-launch-out", 1), "rank 0 vs rank 1")
    assert int(ours["global_step"].reshape(-1)[0]) == 32  # 256 samples / 2 ranks / batch 8, 2 epochs
    assert processes.leftovers() == []


@pytest.mark.mindspore
def test_a_dead_scheduler_fails_the_job_at_once(tmp_path: Path, processes: Processes) -> None:
    """Without its scheduler MindSpore's cluster cannot communicate: the launcher stops every rank, exit 1."""
    run_dir = tmp_path / "run"
    env = environment(tmp_path, PLAIN_SLEEP="120")  # ranks that would run for two minutes
    started = time.monotonic()
    launcher = processes.start([sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--run-dir", str(run_dir),
                                "--grace-period", "2", str(PLAIN_SCRIPT)], env, tmp_path / "launcher.out")
    job_file = run_dir / "job.json"
    while not job_file.exists() and time.monotonic() - started < 60 and launcher.poll() is None:
        time.sleep(0.1)
    assert job_file.exists(), (tmp_path / "launcher.out").read_text()
    info = json.loads(job_file.read_text())
    processes.remember(launcher.pid)
    os.kill(info["scheduler_pid"], signal.SIGKILL)
    code = launcher.wait(60)
    out = (tmp_path / "launcher.out").read_text()
    assert code == 1, out
    assert f"job failed: MindSpore's scheduler (pid {info['scheduler_pid']})" in out
    assert "SIGKILL" in out and str(run_dir / "logs" / "scheduler.log") in out
    assert "plain rank 0 done" not in out and "plain rank 1 done" not in out  # stopped, not waited for
    assert processes.leftovers() == []


@pytest.mark.mindspore
def test_a_scheduler_no_rank_joined_is_stopped_with_the_job(tmp_path: Path, processes: Processes) -> None:
    """Ranks that never call init() leave the scheduler waiting for nobody: it is stopped, not waited for."""
    code, out = processes.run([sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--run-dir",
                               str(tmp_path / "run"), str(PLAIN_SCRIPT)], environment(tmp_path),
                              tmp_path / "launcher.out", timeout=120)
    assert code == 0, out
    assert "plain rank 0 done" in out and "plain rank 1 done" in out
    assert "started MindSpore's scheduler" in out and "after the job ended" not in out
    assert processes.leftovers() == []
