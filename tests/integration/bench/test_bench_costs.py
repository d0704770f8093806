"""Every benchmark's every path, in a short form (issue 45), the cost benchmarks here (snapshot,
replication, training overhead, MindIO, node loss; the recovery benchmarks: test_bench_recoveries.py): a change to an example or to mindft that
breaks a benchmark fails here, not on the day someone measures. bench/step_cost.py and
bench/coordination.py have their own smoke runs (test_bench_smoke.py).

Timings are not asserted (speed is the benchmarks' to measure); each run must end with exit 0, its
JSON written and its verdict line printed, and that JSON must hold every figure docs/performance.md
marks for the benchmark (bench/figures.py --keys: the page names no value the benchmark stopped writing).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_runs import run_bench
from harness import hosts_or_skip, require

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_snapshot_measures_every_copy_and_checksum(tmp_path: Path) -> None:
    out = run_bench("snapshot.py", "--quick", "--output", str(tmp_path / "s.json"))
    (row,) = json.loads((tmp_path / "s.json").read_text())["results"]
    assert row["params"] == 1_000_000 and {"copyto", "capture", "restore_into", "crc32"} <= row["gb_per_s"].keys()
    assert "capture+wait GB/s" in out


def test_replication_runs_every_mode_once(tmp_path: Path) -> None:
    out = run_bench("replication.py", "--width", "128", "--steps", "6", "--rounds", "1", "--batch", "8",
                "--modes", "hand_plain,hand_sync,hand_async,hand_budget,none,rank_stream,agent,agent_budget",
                "--output", str(tmp_path / "rep.json"))
    result = json.loads((tmp_path / "rep.json").read_text())
    modes = ["hand_plain", "hand_sync", "hand_async", "hand_budget", "none", "rank_stream", "agent", "agent_budget"]
    assert [job["mode"] for job in result["jobs"]] == modes and list(result["summary"]) == modes
    assert "agent_budget:" in out


def test_train_overhead_ranks_runs_every_mode(tmp_path: Path) -> None:
    out = run_bench("train_overhead_ranks.py", "--nproc", "2", "--width", "128", "--batch-sizes", "16", "--dp", "on",
                "--rounds", "1", "--warmup", "2", "--steps", "6", "--modes", "plain", "mindft", "coordination",
                "control", "metrics", "--output", str(tmp_path / "t.json"))
    assert json.loads((tmp_path / "t.json").read_text()) and "wrote" in out


def test_train_overhead_runs_every_column() -> None:
    out = run_bench("train_overhead.py", "--batch-sizes", "16", "--rounds", "1", "--steps", "2", "--every", "2",
                "--budget-steps", "4", "--ckpt-steps", "1")
    assert "wrote" in out


def test_mindio_runs_both_backends() -> None:
    require("mindio_ttp", "MindIO TFT's wheel (../shared/wheels/)")
    out = run_bench("mindio.py", "--quick")
    assert "recovery, UCE on 1 of 4 ranks" in out


def test_node_loss_runs_a_standby_and_a_spare(tmp_path: Path) -> None:
    hosts_or_skip()
    out = run_bench("node_loss.py", "--quick", "--output", str(tmp_path / "n.json"))
    result = json.loads((tmp_path / "n.json").read_text())
    assert len(result["losses"]) == 1 and len(result["steady"]) == 1 and "wrote" in out
    assert " 0 contradicted" in run_bench("figures.py", "--keys", str(tmp_path / "n.json"))
