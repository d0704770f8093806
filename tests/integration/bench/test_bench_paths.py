"""Every benchmark's every path, in a short form (issue 45): a change to an example or to mindft that
breaks a benchmark fails here, not on the day someone measures. bench/step_cost.py and
bench/coordination.py have their own smoke runs (test_bench_smoke.py).

Timings are not asserted (speed is the benchmarks' to measure); each run must end with exit 0, its
JSON written and its verdict line printed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import hosts_or_skip, require

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
FOREIGN = ("MINDFT_INSECURE", "MINDFT_KEY_FILE", "MS_TFT_PORT", "MS_NODE_ID", "MS_WORKER_NUM", "MINDFT_PRELOAD")


def bench(script: str, *args: str, timeout: float = 540) -> str:
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_recovery_runs_its_three_ways_to_identical_weights(tmp_path: Path) -> None:
    out = bench("recovery.py", "--quick", "--epochs", "1", "--fault-step", "8", "--checkpoint-every", "4",
                "--step-seconds", "0.02", "--output", str(tmp_path / "r.json"))
    result = json.loads((tmp_path / "r.json").read_text())
    assert {kind: len(rows) for kind, rows in result["rows"].items()} == {"a": 1, "b": 1, "c": 1}
    assert result["weights_identical"] == [True] and "bit-identical across (a), (b), (c): yes" in out


def test_goodput_runs_mindft_and_kill_all_under_one_schedule(tmp_path: Path) -> None:
    out = bench("goodput.py", "--minutes", "0.3", "--mtbf", "5", "--step-seconds", "0.03", "--checkpoint-every", "20",
                "--output", str(tmp_path / "g.json"))
    result = json.loads((tmp_path / "g.json").read_text())
    kinds = {fault[1] for fault in result["config"]["faults"]}
    assert kinds == {"kill", "uce", "hot-reset"}, result["config"]["faults"]
    assert result["faults_hit"]["a"] and result["faults_hit"]["b"]  # both ways met faults
    assert 0 < result["results"]["a"]["goodput"] <= 1.05 and 0 < result["results"]["b"]["goodput"] <= 1.05
    assert result["weights_identical"] and "ratio of goodput (a)/(b)" in out


def test_formation_runs_both_heartbeat_intervals(tmp_path: Path) -> None:
    out = bench("formation.py", "--quick", "--epochs", "1", "--fault-step", "6", "--step-seconds", "0.02",
                "--output", str(tmp_path / "f.json"))
    assert json.loads((tmp_path / "f.json").read_text()) and "wrote" in out


def test_snapshot_measures_every_copy_and_checksum(tmp_path: Path) -> None:
    out = bench("snapshot.py", "--quick", "--output", str(tmp_path / "s.json"))
    (row,) = json.loads((tmp_path / "s.json").read_text())["results"]
    assert row["params"] == 1_000_000 and {"copyto", "capture", "restore_into", "crc32"} <= row["gb_per_s"].keys()
    assert "capture+wait GB/s" in out


def test_replication_runs_every_mode_once(tmp_path: Path) -> None:
    out = bench("replication.py", "--width", "128", "--steps", "6", "--rounds", "1", "--batch", "8",
                "--modes", "hand_plain,hand_sync,hand_async,hand_budget,none,rank_stream,agent,agent_budget",
                "--output", str(tmp_path / "rep.json"))
    rows = json.loads((tmp_path / "rep.json").read_text())["rows"]
    assert {row["mode"] for row in rows} >= {"hand_plain", "hand_sync", "agent", "agent_budget"}, rows
    assert "wrote" in out


def test_train_overhead_ranks_runs_every_mode(tmp_path: Path) -> None:
    out = bench("train_overhead_ranks.py", "--nproc", "2", "--width", "128", "--batch-sizes", "16", "--dp", "on",
                "--rounds", "1", "--warmup", "2", "--steps", "6", "--modes", "plain", "mindft", "coordination",
                "control", "metrics", "--output", str(tmp_path / "t.json"))
    assert json.loads((tmp_path / "t.json").read_text()) and "wrote" in out


def test_train_overhead_runs_every_column() -> None:
    out = bench("train_overhead.py", "--batch-sizes", "16", "--rounds", "1", "--steps", "2", "--every", "2",
                "--budget-steps", "4", "--ckpt-steps", "1")
    assert "wrote" in out


def test_mindio_runs_both_backends() -> None:
    require("mindio_ttp", "MindIO TFT's wheel (../shared/wheels/)")
    out = bench("mindio.py", "--quick")
    assert "recovery, UCE on 1 of 4 ranks" in out


def test_node_loss_runs_a_standby_and_a_spare(tmp_path: Path) -> None:
    hosts_or_skip()
    out = bench("node_loss.py", "--quick", "--output", str(tmp_path / "n.json"))
    result = json.loads((tmp_path / "n.json").read_text())
    assert len(result["losses"]) == 1 and len(result["steady"]) == 1 and "wrote" in out
