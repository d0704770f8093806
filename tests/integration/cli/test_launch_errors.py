"""mindft-launch and the mindft CLI on errors of setup: one line naming the cause and the fix,
exit 2 for a configuration error, nothing left behind; and an unprotected launch that trains."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import FAKE_RANK, ROOT, environment, free_port_pair

DEFAULT_RESET_DIR = Path("/user/restore/reset/config")



def launch(tmp_path: Path, *args: str, timeout: float = 120.0, **env: str) -> subprocess.CompletedProcess:
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "mindft.cli.launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=environment(tmp_path, TMPDIR=str(temp), **env))


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", [True, False])
def test_a_taken_port_is_refused_in_one_line_and_leaves_nothing(tmp_path: Path, listener: tuple[int, int],
                                                                 scheduler: bool) -> None:
    port, pid = listener
    args = ("--master-port", str(port)) if scheduler else ("--no-scheduler", "--master-port", str(port - 1))
    result = launch(tmp_path, *args, str(FAKE_RANK), MS_ENABLE_TFT="{RSC:1}")
    assert result.returncode == 2, result.stdout + result.stderr
    what = "MindSpore's scheduler port" if scheduler else "the controller's port"
    assert result.stderr.strip() == (f"mindft-launch: port {port} on 127.0.0.1, {what}"
                                     f"{' (--master-port)' if scheduler else ''}, is in use by pid {pid} "
                                     f"({Path(f'/proc/{pid}/comm').read_text().strip()}); choose another --master-port")
    assert "Traceback" not in result.stdout + result.stderr
    assert list((tmp_path / "tmp").iterdir()) == []      # no run directory, no key pair


@pytest.mark.slow
def test_nodes_with_different_keys_name_both_causes(tmp_path: Path) -> None:
    port = free_port_pair()
    keys = []
    for name in ("a", "b"):
        keys.append(tmp_path / f"{name}.json")
        subprocess.run([sys.executable, "-m", "mindft.cli.main", "keygen", str(keys[-1])], check=True,
                       capture_output=True, env=environment(), timeout=60)
    env = environment(tmp_path, LAUNCH_DIR=str(tmp_path), LAUNCH_STEPS="20", MS_ENABLE_TFT="{RSC:1}",
                      MINDFT_HEARTBEAT_INTERVAL="0.1", MINDFT_REGISTER_TIMEOUT="20")
    nodes = []
    try:
        for node in (0, 1):
            with open(tmp_path / f"node{node}.out", "wb") as out:
                nodes.append(subprocess.Popen(
                    [sys.executable, "-m", "mindft.cli.launch", "--no-scheduler", "--nproc", "1", "--nnodes", "2",
                     "--node-rank", str(node), "--master-port", str(port), "--key-file", str(keys[node]),
                     "--max-restarts", "0", "--run-dir", str(tmp_path / f"run{node}"), str(FAKE_RANK)],
                    env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        nodes[1].wait(120)
        nodes[0].wait(120)
    finally:
        for process in nodes:
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()
    out = (tmp_path / "node1.out").read_text()
    assert nodes[1].returncode == 1, out
    both = ("either no controller runs there: start the job with mindft-launch, node 0 included, or unset "
            "MS_ENABLE_TFT to train without fault tolerance; or it holds a different key, and CurveZMQ gives no "
            "answer to a wrong key: give every node the same --key-file")
    rank_line = next(line for line in out.splitlines() if line.startswith("[rank 1]") and "answers" in line)
    assert "no mindft controller answers at tcp://127.0.0.1:" in rank_line and both in rank_line, out
    assert "(through this node's relay at ipc://" in rank_line, out  # the ranks' traffic goes through it
    agent_line = next(line for line in out.splitlines() if line.startswith("[mindft-launch]") and both in line)
    assert "no mindft controller answers this node agent" in agent_line, out


@pytest.mark.slow
@pytest.mark.parametrize("command", [["inject", "--rank", "0", "--fault", "hot-reset", "--recover-after", "0"],
                                     ["simulate-device-plugin", "--rank", "0", "--hold", "0"]])
def test_a_hot_reset_without_a_job_or_its_directory_is_refused(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "no" / "such" / "reset.json"
    result = subprocess.run([sys.executable, "-m", "mindft.cli.main", *command], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env=environment(MINDFT_RESET_FILE=str(missing)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and f"directory {missing.parent} does not exist" in result.stderr
    assert not (tmp_path / "no").exists()
    if DEFAULT_RESET_DIR.parent.parent.exists():
        return  # a machine with the device plugin's mount: the default path is not ours to test
    default = subprocess.run([sys.executable, "-m", "mindft.cli.main", *command], capture_output=True, text=True,
                             timeout=60, cwd=ROOT, env=environment())
    assert default.returncode == 2 and str(DEFAULT_RESET_DIR) in default.stderr
    assert not DEFAULT_RESET_DIR.parent.parent.exists()


@pytest.mark.slow
@pytest.mark.mindspore
def test_an_unprotected_launch_of_the_example_trains(tmp_path: Path) -> None:
    """The README: without MS_ENABLE_TFT the ranks train unprotected (no placeholder MS_TFT_PORT)."""
    result = launch(tmp_path, "--nproc", "1", "--run-dir", str(tmp_path / "run"),
                    str(ROOT / "examples" / "train_model.py"), "--epochs", "1", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "fault tolerance is OFF" in out and "MS_TFT_PORT" not in out
