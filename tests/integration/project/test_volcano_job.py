"""The Volcano job's mindft-launch command run here: the manifest's command trains (the manifests'
fields: tests/unit/test_deploy.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from k8s_manifests import containers, volcano_job

from harness import ROOT, environment, free_port_pair

pytestmark = pytest.mark.mindspore


@pytest.mark.timeout(300)
def test_the_volcano_jobs_command_trains_here_on_cpu(tmp_path: Path) -> None:
    """The manifest's mindft-launch command, scaled to one node of 2 CPU processes and pointed at
    this machine, with the device the pod's environment names overridden: it trains, protected,
    to the end (a manifest cannot drift from a script that runs)."""
    _, job = volcano_job()
    [task] = job["spec"]["tasks"]
    [container] = containers(task["template"]["spec"])
    here = {"--nproc": "2", "--nnodes": "1", "--master-addr": "127.0.0.1",
            "--master-port": str(free_port_pair()), "--key-file": str(tmp_path / "keys.json"),
            "--out": str(tmp_path / "out")}
    args = [str(arg) for arg in container["args"]]
    args = [here.get(before, arg) if before in here else arg.replace("/opt/mindft/", f"{ROOT}/")
            for before, arg in zip(["", *args], args)]
    subprocess.run([sys.executable, "-m", "mindft.cli.main", "keygen", str(tmp_path / "keys.json")], check=True,
                   capture_output=True)
    env = environment(tmp_path, **{e["name"]: str(e["value"]) for e in container["env"]})
    env.update(DEVICE_TARGET="CPU", MINDFT_RESET_FILE=str(tmp_path / "reset.json"),
               MINDFT_DUMP_DIR=str(tmp_path / "dump"))
    run = subprocess.run([sys.executable, "-m", "mindft.cli.launch", "--run-dir", str(tmp_path / "run"), *args],
                         env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "NORMAL → DONE (all 2 ranks finished" in run.stdout, run.stdout[-3000:]  # protected by mindft
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank0.npz", "rank1.npz"]
