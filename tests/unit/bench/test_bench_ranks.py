"""bench/train_overhead_ranks.py's arithmetic: the order of the modes (every mode in every position
equally often) and the ratios against plain of the same round (its runs: the benchmark's own)."""
from __future__ import annotations

import sys

import pytest

from harness import ROOT


def _ranks_bench():
    """bench/train_overhead_ranks.py as a module (bench/ is not a package)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import train_overhead_ranks
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return train_overhead_ranks


def test_the_ranks_benchmark_runs_every_mode_in_every_position_equally_often() -> None:
    orders = _ranks_bench().orders
    assert orders(["plain", "mindft"]) == [["plain", "mindft"], ["mindft", "plain"], ["mindft", "plain"],
                                           ["plain", "mindft"]]  # ABBA
    rounds = orders(["plain", "mindft", "coordination"])
    assert len(rounds) == 6 and all(sorted(order) == sorted(rounds[0]) for order in rounds)
    for mode in rounds[0]:
        assert sorted(order.index(mode) for order in rounds) == [0, 0, 1, 1, 2, 2]


def test_the_ranks_benchmark_sets_each_mode_against_plain_of_the_same_round() -> None:
    summarize = _ranks_bench().summarize
    step_ms = {(0, "plain"): 100.0, (0, "mindft"): 103.0, (0, "control"): 98.0, (0, "coordination"): 101.0,
               (1, "plain"): 200.0, (1, "mindft"): 202.0, (1, "control"): 210.0, (1, "coordination"): 200.0}
    jobs = [{"round": r, "mode": mode, "batch": 64, "dp": True, "nproc": 2, "nnodes": 1, "state_bytes": 1 << 20,
             "step_ms": ms, "cpu_ms": ms, "rank_hwm": [0, 0], "launcher_hwm": [0], "job_pss_peak": 0, "shm_peak": 0,
             "load_before": [1.0], "load_after": [2.0], "every": 10, "expected_overhead": 0.01,
             "parts_ms": {"wait_peers": 0.0}} for (r, mode), ms in step_ms.items()]
    row = summarize(jobs, 64, True)
    assert row["rounds"] == 2
    assert row["ratio"] == pytest.approx([1.01, 1.02, 1.03])
    assert row["control_ratio"] == pytest.approx([0.98, 1.015, 1.05])
    assert row["mindft_over_unprotected"] == pytest.approx([2 * 202 / 410, (2 * 103 / 198 + 2 * 202 / 410) / 2,
                                                             2 * 103 / 198])
    assert row["coordination_ratio"] == pytest.approx([1.0, 1.005, 1.01])
    assert row["mindft_over_coordination"] == pytest.approx([1.01, (103 / 101 + 1.01) / 2, 103 / 101])


def test_the_recovery_benchmarks_disk_checkpoint_ranks_define_every_option_train_dp_reads() -> None:
    """bench/recovery.py's (c) runs examples/train_dp.py's build and fault drill with a parser of its
    own: every ``args.X`` they read must be one of its options (``mindspore_tft`` once was not)."""
    import ast

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import recovery
    finally:
        sys.path.remove(str(ROOT / "bench"))
    tree = ast.parse((ROOT / "examples" / "train_dp.py").read_text())
    used = {node.attr for function in tree.body if isinstance(function, ast.FunctionDef)
            and function.name in ("build", "fault_drill", "fault_after_update", "loop_step")
            for node in ast.walk(function)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"}
    assert "mindspore_tft" in used and "fault_step" in used
    args = recovery.checkpoint_parser().parse_args(["--checkpoint-every", "10", "--checkpoint-dir", "/tmp/x"])
    assert not [name for name in used if not hasattr(args, name)]
