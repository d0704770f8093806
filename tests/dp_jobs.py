"""What the data-parallel job tests share: examples/train_dp.py under mindft-launch with msrun's
flags on one node, the controller's status polled from job.json, the device plugin played by
`mindft simulate-device-plugin`, the steps of the dying gasps written."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from harness import ROOT, Processes, environment, free_port_pair
from mindft.net.channel import Client, ControllerUnreachable
from mindft.net.keys import load_keys

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


def api_args(api: str) -> list[str]:
    """The example's flag for ``api``: ``model`` (Model.train) or ``loop`` (a hand-written loop)."""
    return ["--loop"] if api == "loop" else []


def job_status(job_file: Path):
    """The controller's status of the job whose job.json is ``job_file``."""
    info = json.loads(job_file.read_text())
    keys = None if info["insecure"] else load_keys(Path(info["key_file"]))
    return Client(info["controller"], keys, timeout=2.0).status()


def wait_for_status(job_file: Path, launcher: subprocess.Popen, output: Path, ready, what: str,
                    timeout: float = 240.0):
    """Poll the job's status until ``ready(status)``; fail naming ``what`` if the job ends first or it times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, f"the job ended before {what}:\n{output.read_text()[-4000:]}"
        if job_file.exists():
            try:
                status = job_status(job_file)
            except ControllerUnreachable:
                status = None
            if status is not None and ready(status):
                return status
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout} s:\n{output.read_text()[-4000:]}")


def device_plugin(job_file: Path, rank: int, outcome: str, tmp: Path) -> subprocess.CompletedProcess:
    """The device plugin's hot reset of ``rank``'s chip, as `mindft simulate-device-plugin` plays it."""
    return subprocess.run([sys.executable, "-m", "mindft.cli.main", "simulate-device-plugin", "--job", str(job_file),
                           "--rank", str(rank), "--hold", "1", "--outcome", outcome, "--process-deadline", "30"],
                          env=environment(tmp), capture_output=True, text=True, timeout=120, cwd=ROOT)


def dumped_steps(run_dir: Path) -> list[int]:
    """The step of every dying-gasp checkpoint written for the job."""
    steps = []
    for path in sorted((run_dir / "dump").rglob("*.ckpt")):
        checkpoint = ms.load_checkpoint(str(path))
        steps.append(int(np.asarray(checkpoint["global_step"].asnumpy()).reshape(-1)[0]))
    return steps
