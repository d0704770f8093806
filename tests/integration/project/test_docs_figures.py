"""The README's quick start states what the test command costs; the counts are checked here against
what pytest collects (the times after each run: tests/conftest.py)."""
from __future__ import annotations

import re
import subprocess
import sys

from harness import ROOT
from readme_figures import TOLERANCE, off_by, readme_figures


def collected(*paths: str) -> int:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-n", "0", *paths], capture_output=True, text=True, timeout=300, cwd=ROOT)
    found = re.search(r"^(\d+) tests? collected", done.stdout, re.MULTILINE)
    assert done.returncode == 0 and found, done.stdout[-3000:] + done.stderr[-3000:]
    return int(found[1])


def test_the_readme_states_the_suites_and_the_fast_tiers_test_counts() -> None:
    figures = readme_figures()
    suite, fast = collected("tests"), collected("tests/unit")
    assert off_by(figures.suite_tests, suite) <= TOLERANCE, f"README: ~{figures.suite_tests} tests; collected {suite}"
    assert off_by(figures.fast_tests, fast) <= TOLERANCE, f"README: ~{figures.fast_tests} fast tests; collected {fast}"
