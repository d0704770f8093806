"""Each node agent's own /metrics, scraped over HTTP during a real job of two mindft-launch
nodes on loopback (one key, a killed rank on node 1 restarted): node 1 serves its snapshots'
bytes in its memory, its ranks' restarts and its replication on a port of its own; node 0 its own
beside the controller's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import free_port, free_port_pair
from launching import DEADLINE, RANK_SCRIPT

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Optional[Samples]:
    """Every sample at http://127.0.0.1:PORT/metrics, or None while nothing answers there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), float("nan"))


def test_each_node_serves_its_own_metrics_during_the_job(tmp_path: Path) -> None:
    port = free_port_pair()  # the controller's
    metrics = {0: free_port(), 1: free_port()}
    keys = tmp_path / "keys.json"
    assert subprocess.run([sys.executable, "-c", "from mindft.cli.main import main; main()", "keygen", str(keys)],
                          capture_output=True, timeout=30).returncode == 0
    env = {**os.environ, "LAUNCH_DIR": str(tmp_path), "LAUNCH_STEPS": "400", "LAUNCH_STEP_TIME": "0.05",
           "LAUNCH_CRASH": "3:10", "MINDFT_HEARTBEAT_INTERVAL": "0.1",
           "MINDFT_RESET_FILE": str(tmp_path / "reset.json"), "MINDFT_REPAIR_TIMEOUT": "30",
           "MS_ENABLE_TFT": "{RSC:1}"}
    for name in ("MINDFT_KEY_FILE", "MINDFT_METRICS_PORT", "MINDFT_METRICS_ADDR"):
        env.pop(name, None)
    nodes: dict[int, subprocess.Popen] = {}
    seen: Optional[Samples] = None
    try:
        for node in (1, 0):
            with open(tmp_path / f"node{node}.out", "wb") as out:
                nodes[node] = subprocess.Popen(
                    [sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--nnodes", "2", "--node-rank", str(node),
                     "--master-port", str(port), "--key-file", str(keys), "--run-dir", str(tmp_path / f"run{node}"),
                     "--metrics-port", str(metrics[node]), str(RANK_SCRIPT)],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline and any(p.poll() is None for p in nodes.values()):
            seen = scrape(metrics[1])
            if (seen is not None and value(seen, "mindft_node_rank_restarts_total", node="1", rank="3") == 1
                    and value(seen, "mindft_node_snapshot_bytes", node="1", rank="3") > 0
                    and value(seen, "mindft_node_replicated_step", node="1", rank="2") >= 0):
                break
            time.sleep(0.2)
        node0 = scrape(metrics[0])
        codes = [nodes[node].wait(DEADLINE) for node in (0, 1)]
    finally:
        for process in nodes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    out0, out1 = (tmp_path / "node0.out").read_text(), (tmp_path / "node1.out").read_text()
    assert codes == [0, 0], out0 + out1
    assert seen is not None, f"node 1 never served its metrics\n{out1}"
    # Node 1's ranks 2 and 3: rank 3 killed itself in step 10 and was restarted once.
    assert value(seen, "mindft_node_rank_restarts_total", node="1", rank="3") == 1, (seen, out1)
    assert value(seen, "mindft_node_rank_restarts_total", node="1", rank="2") == 0
    assert value(seen, "mindft_node_rank_restarts_used", node="1", rank="3") == 1
    for rank in ("2", "3"):
        assert value(seen, "mindft_node_snapshot_bytes", node="1", rank=rank) > 0, rank
    assert value(seen, "mindft_node_shared_memory_bytes", node="1") > 0
    assert value(seen, "mindft_node_replica_pushes_total", node="1") >= 1
    assert value(seen, "mindft_node_replica_sent_bytes_total", node="1") > 0
    assert value(seen, "mindft_node_replicated_step", node="1", rank="2") >= 0
    assert not any(name.startswith("mindft_job_") for name, _ in seen)  # the controller's are node 0's
    # Node 0 serves its own beside the controller's, on its one port.
    assert node0 is not None, out0
    assert value(node0, "mindft_node_max_restarts", node="0") >= 1
    assert value(node0, "mindft_job_step") >= 0
    assert f"metrics http://127.0.0.1:{metrics[1]}/metrics" in out1
