"""Two mindft-launch processes on loopback as two nodes: the node agents replicate, the ranks do not.

examples/train_mlp.py (MindSpore, FaultTolerantLoop) runs one rank per node. Each node
agent streams its rank's newest snapshot to the other node's keeper; the controller's
status (and ``mindft status``) shows each rank's replicated step, and the ranks
register the keeper of their node instead of a replica server of their own.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from harness import ROOT, environment, free_port_pair
from mindft.net.channel import Client, ControllerUnreachable
from mindft.cli.main import main as cli
from mindft.net.keys import generate_keys

pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

DEADLINE = 240.0  # MindSpore's import and two ranks on 2 busy cores

def test_the_node_agents_replicate_every_rank_and_status_shows_it(tmp_path: Path) -> None:
    port = free_port_pair()
    keys_path = tmp_path / "keys.json"
    keys = generate_keys(keys_path)
    env = environment(tmp_path, MS_ENABLE_TFT="{RSC:1}", MINDFT_REGISTER_TIMEOUT="120")
    launchers: list[subprocess.Popen] = []
    outputs = [tmp_path / f"node{node}.out" for node in (0, 1)]
    seen: dict[int, psutil.Process] = {}
    try:
        for node in (1, 0):
            with open(outputs[node], "wb") as out:
                launchers.append(subprocess.Popen(
                    [sys.executable, "-m", "mindft.cli.launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node),
                     "--master-port", str(port), "--no-scheduler", "--key-file", str(keys_path),
                     "--run-dir", str(tmp_path / f"run{node}"), str(ROOT / "examples" / "train_mlp.py"),
                     "--steps", "10000000"], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True))
        client = Client(f"127.0.0.1:{port + 1}", keys, timeout=2.0)
        deadline = time.monotonic() + DEADLINE
        status = None
        while True:
            for launcher in launchers:
                for child in psutil.Process(launcher.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
            assert all(l.poll() is None for l in launchers), "a launcher ended:\n" + "\n".join(
                o.read_text(errors="replace")[-3000:] for o in outputs)
            try:
                status = client.status()
            except ControllerUnreachable:
                status = None
            if status is not None and len(status.ranks) == 2 and all(r.replicated >= 2 for r in status.ranks):
                break
            assert time.monotonic() < deadline, f"no replicas in the status: {status}"
            time.sleep(0.2)
        shown = CliRunner().invoke(cli, ["status", "--address", f"127.0.0.1:{port + 1}", "--key-file",
                                         str(keys_path)])
        assert shown.exit_code == 0, shown.output
        assert "REPLICA" in shown.output.splitlines()[1] and "LOST PROTECTION" not in shown.output
        for launcher in launchers:
            launcher.send_signal(signal.SIGTERM)
        for launcher in launchers:
            launcher.wait(60)
    finally:
        for process in [*seen.values(), *(psutil.Process(l.pid) for l in launchers if l.poll() is None)]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
    node0, node1 = (o.read_text(errors="replace") for o in outputs)
    keeper = {node: re.search(r"replica keeper listening on (tcp://\S+)", text)[1]
              for node, text in ((0, node0), (1, node1))}
    # Each rank announced its own node's keeper: the ranks run no replica server and push nothing.
    assert {r.rank: r.replica_endpoint for r in status.ranks} == {0: keeper[0], 1: keeper[1]}
    assert f"streams its ranks' snapshots to the keeper at {keeper[1]}" in node0
    assert f"streams its ranks' snapshots to the keeper at {keeper[0]}" in node1
    assert "rank=0 step" in node0 and "is held by the keeper" in node0
    # At the end each agent holds the other node's rank.
    assert re.search(r"holding 1 replica\(s\) of the previous node \(\{1: \d+\}", node0), node0[-2000:]
    assert re.search(r"holding 1 replica\(s\) of the previous node \(\{0: \d+\}", node1), node1[-2000:]
    assert "LOST PROTECTION" not in node0 + node1
