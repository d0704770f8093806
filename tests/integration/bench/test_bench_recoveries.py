"""Every benchmark's every path, in a short form (issue 45), the recovery benchmarks here (recovery,
goodput, formation; the cost benchmarks: test_bench_costs.py): a change to an example or to mindft that
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_recovery_runs_its_three_ways_to_identical_weights(tmp_path: Path) -> None:
    out = run_bench("recovery.py", "--quick", "--epochs", "1", "--fault-step", "8", "--checkpoint-every", "4",
                "--step-seconds", "0.02", "--output", str(tmp_path / "r.json"))
    result = json.loads((tmp_path / "r.json").read_text())
    assert {kind: len(rows) for kind, rows in result["rows"].items()} == {"a": 1, "b": 1, "c": 1}
    assert result["weights_identical"] == [True] and "bit-identical across (a), (b), (c): yes" in out
    assert " 0 contradicted" in run_bench("figures.py", "--keys", str(tmp_path / "r.json"))


def test_goodput_runs_mindft_and_kill_all_under_one_schedule(tmp_path: Path) -> None:
    out = run_bench("goodput.py", "--minutes", "0.15", "--mtbf", "3", "--step-seconds", "0.02", "--checkpoint-every", "20",
                "--output", str(tmp_path / "g.json"))
    result = json.loads((tmp_path / "g.json").read_text())
    kinds = {fault[1] for fault in result["config"]["faults"]}
    assert kinds == {"kill", "uce", "hot-reset"}, result["config"]["faults"]
    assert result["faults_hit"]["a"] and result["faults_hit"]["b"]  # both ways met faults
    assert 0 < result["results"]["a"]["goodput"] <= 1.05 and 0 < result["results"]["b"]["goodput"] <= 1.05
    assert result["weights_identical"] and "ratio of goodput (a)/(b)" in out
    assert " 0 contradicted" in run_bench("figures.py", "--keys", str(tmp_path / "g.json"))


def test_formation_runs_both_heartbeat_intervals(tmp_path: Path) -> None:
    out = run_bench("formation.py", "--quick", "--epochs", "1", "--fault-step", "6", "--step-seconds", "0.02",
                "--output", str(tmp_path / "f.json"))
    assert json.loads((tmp_path / "f.json").read_text()) and "wrote" in out
