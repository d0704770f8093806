"""bench/elastic.py's short form (issue 43's figure; the other benchmarks' short forms:
test_bench_recoveries.py, test_bench_costs.py): a node lost for good on three hosts, the job shrinking,
waiting for the node, and ending with its dying gasps before a fresh job, each path once.

Only what holds on any machine is asserted: every way measured, the shrink ahead of a dying gasp and
a new job (which waits a repair timeout and starts every process anew), and every figure
docs/performance.md marks for the benchmark still written (bench/figures.py --keys).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_runs import run_bench
from harness import hosts_or_skip
from mindft.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_elastic_runs_shrink_wait_and_gasp_on_three_hosts(tmp_path: Path) -> None:
    hosts_or_skip()
    out = run_bench("elastic.py", "--quick", "--output", str(tmp_path / "e.json"), timeout=570)
    ways = json.loads((tmp_path / "e.json").read_text())["ways"]
    assert sorted(ways) == ["a", "b", "c"] and all(w["resumed_after_seconds"] > 0 for w in ways.values()), ways
    assert ways["a"]["codes"] == {"node0": 0, "node1": 0} and ways["b"]["codes"] == \
        {"node0": 0, "node1": 0, "node2-again": 0}, ways
    assert ways["c"]["codes"] == {"node0": ExitCode.DUMPED, "node1": ExitCode.DUMPED, "fresh node0": 0,
                                  "fresh node1": 0}, ways  # the failed job's dying gasps, the fresh job to its end
    assert ways["a"]["steps_per_second_before"] > 0 and ways["a"]["steps_per_second_after"] > 0, ways["a"]
    assert ways["a"]["resumed_after_seconds"] < ways["c"]["resumed_after_seconds"], ways
    assert "wrote" in out
    assert " 0 contradicted" in run_bench("figures.py", "--keys", str(tmp_path / "e.json"))
