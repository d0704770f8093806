"""Slow ranks in a real data-parallel MindSpore job (examples/train_dp.py, MCCL all-reduce): rank 1
held to two thirds of the CPU (SIGSTOP/SIGCONT, a CPU quota any kernel has) is flagged within the
windows set, shown by `mindft status` and logged, and cleared once it runs freely again; a healthy job
on a busy machine (a busy process per core beside the job) raises no flag (SLOW_RANKS_SOAK_SECONDS: how
long, 60 by default; the issue's 10 minutes with 600). One busy process beside two ranks on two cores
is another matter: the kernel keeps it on one rank's core for tens of seconds, that rank works at half
speed, and it is flagged, as a noisy neighbour should be.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dp_jobs import job_status, launch, wait_for_status

from harness import ROOT, Processes, Throttle, environment
from mindft.net.channel import ControllerUnreachable
from mindft.observe.events import RankSlow, read

pytestmark = [pytest.mark.mindspore, pytest.mark.timeout(900)]

WINDOWS = {"MINDFT_SLOW_WINDOW": "3", "MINDFT_SLOW_WINDOWS": "2", "MINDFT_SLOW_THRESHOLD": "0.3"}


def stop_job(launcher: subprocess.Popen) -> int:
    """The job ran long enough: SIGTERM its launcher, which stops every rank."""
    launcher.send_signal(signal.SIGTERM)
    return launcher.wait(60)


def flags(run_dir: Path) -> list[RankSlow]:
    return [event.record for event in read(run_dir) if isinstance(event.record, RankSlow)]


def test_a_rank_held_to_two_thirds_of_the_cpu_is_flagged_then_cleared(tmp_path: Path, processes: Processes) -> None:
    launcher, output = launch(processes, tmp_path, "run", 2, "--epochs", "2000", wait=False, **WINDOWS)
    job_file = tmp_path / "run" / "job.json"
    status = wait_for_status(job_file, launcher, output, lambda s: s.state == "NORMAL" and
                             all(r.work_ratio > 0 for r in s.ranks), "both ranks' pace measured")
    assert not any(r.slow for r in status.ranks)
    throttle = Throttle(status.ranks[1].pid, 2 / 3)  # its work takes 1.5× as long
    try:
        # Flagged after two slow windows of 3 s in a row (mindft.flow.slow's tests count them exactly); on
        # 2 cores shared with a three-host test a window is sometimes within 1.3× (1.5× expected): 120 s.
        status = wait_for_status(job_file, launcher, output, lambda s: any(r.slow for r in s.ranks), "a slow rank",
                                 timeout=120)
        shown = subprocess.run([sys.executable, "-m", "mindft.cli.main", "status", "--job", str(job_file)],
                               env=environment(tmp_path), capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        throttle.stop()
    assert [r.rank for r in status.ranks if r.slow] == [1], status
    assert status.ranks[1].work_ratio > 1.3, status
    assert "SLOW: rank 1: its own work per step is over its peers' median" in shown.stdout, shown.stdout
    assert "SLOW" in [line for line in shown.stdout.splitlines() if line.startswith("1 ")][0], shown.stdout
    wait_for_status(job_file, launcher, output, lambda s: not any(r.slow for r in s.ranks), "rank 1 cleared",
                    timeout=120)
    stop_job(launcher)
    (flagged, cleared) = flags(tmp_path / "run")
    assert (flagged.rank, flagged.node, flagged.slow, cleared.rank, cleared.slow) == (1, 0, True, 1, False)
    assert "rank 1 (node 0) is slow" in flagged.reason and "rank 1 (node 0) is no longer slow" in cleared.reason
    assert "rank 1 (node 0) is slow" in output.read_text()  # the controller's log line


def test_a_healthy_job_on_a_busy_machine_raises_no_flag(tmp_path: Path, processes: Processes) -> None:
    soak = float(os.environ.get("SLOW_RANKS_SOAK_SECONDS", "60"))
    burners = [processes.start([sys.executable, "-c", "while True: pass"], environment(tmp_path),
                               tmp_path / f"busy-{core}.out") for core in range(os.cpu_count() or 1)]
    # MindCluster's defaults (windows of 30 s) for a soak of 5 minutes or more; 6 windows of 10 s in a minute.
    window = "30" if soak >= 300 else "10"
    launcher, output = launch(processes, tmp_path, "run", 2, "--epochs", "100000", wait=False,
                              MINDFT_SLOW_WINDOW=window, MINDFT_SLOW_WINDOWS="3")
    job_file = tmp_path / "run" / "job.json"
    wait_for_status(job_file, launcher, output, lambda s: s.state == "NORMAL", "training")
    ratios: list[float] = []
    deadline = time.monotonic() + soak
    while time.monotonic() < deadline:
        time.sleep(1.0)
        assert launcher.poll() is None, output.read_text()[-4000:]
        try:
            status = job_status(job_file)
        except ControllerUnreachable:  # a busy machine: asked again in a second
            continue
        assert not any(r.slow for r in status.ranks), status
        ratios += [r.work_ratio for r in status.ranks if r.work_ratio > 0]
    for burner in burners:
        burner.kill()
    stop_job(launcher)
    assert flags(tmp_path / "run") == []
    assert ratios  # measured all along
    print(f"healthy job on a busy machine for {soak:g} s, windows of {window} s: own-work ratios "
          f"{min(ratios):.2f}..{max(ratios):.2f}")
