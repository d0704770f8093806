"""The benchmarks still run against this tree: bench/step_cost.py (2 real ranks with and without
mindft) and bench/coordination.py (64 simulated ranks next to the bare-zmq floor), JSON fields
(bench/train_overhead_ranks.py's order of the modes and its ratios: tests/unit/test_bench_ranks.py).

Timings are not asserted (speed is measured by the benchmark, not by tests); this only keeps
the benchmark from rotting when the processor's API changes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark's processes

REPO = Path(__file__).resolve().parents[3]
ROW_FIELDS = {"variant", "ranks", "steps", "mindft_median_us", "mindft_p99_us", "mindft_mean_us", "call_median_us",
              "open_window_median_us", "window_waits", "step_wall_us", "step_cpu_us", "controller_cpu_per_step_us"}


def test_step_cost_quick_run_writes_both_variants(tmp_path: Path) -> None:
    output = tmp_path / "step_cost.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for name in ("MINDFT_INSECURE", "MINDFT_KEY_FILE", "MS_TFT_PORT", "MS_NODE_ID", "MS_WORKER_NUM"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "step_cost.py"), "--quick", "--ranks", "2",
                           "--steps", "40", "--old", "none", "--output", str(output)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["benchmark"] == "step_cost"
    assert result["config"]["secure"] is True and result["config"]["ranks"] == [2]
    rows = {row["variant"]: row for row in result["rows"]}
    assert set(rows) == {"none", "mindft"}
    for row in rows.values():
        assert ROW_FIELDS <= row.keys()
        assert row["ranks"] == 2 and row["steps"] == 40
    assert set(rows["mindft"]["call_median_us"]) == {"wait_window", "finished", "poll_action"}
    assert rows["none"]["call_median_us"] == {} and rows["none"]["mindft_median_us"] == 0.0
    assert rows["mindft"]["mindft_median_us"] > 0.0  # the calls were really timed
    assert {"median_met", "worst_median_us"} <= result["target"].keys()
    assert "ranks" in done.stdout and "slowdown" in done.stdout


def test_coordination_quick_run_simulated_ranks_next_to_the_floor(tmp_path: Path) -> None:
    output = tmp_path / "coordination.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(REPO / "bench" / "coordination.py"), "--quick", "--real-sizes", "0",
                           "--sim-sizes", "64", "--relay-sizes", "0", "--repeat", "2", "--output", str(output)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(output.read_text())
    rows = result["rows"]
    assert [(r["kind"], r["topology"], r["ranks"], r["repeat"]) for r in rows] == [("simulated", "star", 64, 0),
                                                                                   ("simulated", "star", 64, 1)]
    for row in rows:
        assert row["rounds"] == 3 and row["median_s"] > 0 and row["floor_median_s"] > 0
        # Every simulated rank acknowledged every phase of every round (the warm-up round's
        # count as setup), and said it was done.
        assert row["frames_to_controller"]["rounds"]["ack"] == 64 * 3 * 3
        assert row["frames_to_controller"]["setup"]["ack"] == 64 * 3
        assert row["frames_from_controller"]["setup"]["RegisterAck"] == 64
        assert set(row["phase_median_s"]) == {"PAUSING", "REPAIRING", "ROLLBACK", "RESUMING"}
    assert "bare zmq floor ms" in done.stdout


def test_coordination_quick_run_relayed_ranks_next_to_their_floor(tmp_path: Path) -> None:
    """Ranks behind simulated node agents (protocol 15): each phase crosses a node's link once each
    way, the start barrier's answer and FINISH too."""
    output = tmp_path / "coordination.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(REPO / "bench" / "coordination.py"), "--quick", "--real-sizes", "0",
                           "--sim-sizes", "0", "--relay-sizes", "60", "--nproc", "8", "--output", str(output)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(output.read_text())["rows"]
    assert [(r["kind"], r["topology"], r["ranks"], r["nodes"], r["nproc"]) for r in rows] == [
        ("simulated", "relay", 60, 8, 8)]  # the last node relays 4 ranks
    row = rows[0]
    assert row["rounds"] == 3 and row["median_s"] > 0 and row["floor_median_s"] > 0
    assert row["controller_rss_mb"] >= 0 and "agent_rss_mb" not in row  # no real agent to weigh
    assert row["frames_to_controller"]["rounds"]["ack"] == 8 * 3 * 3  # one AckBatch per node and phase
    assert row["frames_to_controller"]["setup"]["ack"] == 8 * 3  # the warm-up round's
    assert row["frames_to_controller"]["setup"]["other"] == 60 * 2  # each rank's Register and Done, relayed
    assert row["frames_from_controller"]["setup"]["RegisterAck"] == 8
    assert row["frames_from_controller"]["setup"]["Action"] == 8 * 4  # the warm-up's phases and FINISH
    assert "(8 nodes of 8)" in done.stdout
