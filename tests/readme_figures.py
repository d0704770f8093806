"""What the README's quick start says the test command costs: the whole suite's and the fast tier's
test counts and times. The suite checks them (tests/integration/project/test_docs_figures.py: the
counts; tests/conftest.py: the times, said after every whole or fast-tier run)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_LINE = re.compile(r"the whole suite: ~([\d,]+) tests, ~(\d+) min on 2 cores \(fast tier: pytest tests/unit, "
                   r"~([\d,]+) tests, ~(\d+) s\)")
TOLERANCE = 0.1  # a stated count may be this far off the collected one
TIME_TOLERANCE = 0.5  # a stated time: runs on 2 cores vary this much with the machine and its load


@dataclass(frozen=True)
class ReadmeFigures:
    suite_tests: int
    suite_seconds: float
    fast_tests: int
    fast_seconds: float


def readme_figures() -> ReadmeFigures:
    """The figures of the README's test command line (AssertionError when the line lost its form)."""
    found = _LINE.search(README.read_text())
    assert found, f"{README}: the quick start's test command no longer states its cost as {_LINE.pattern!r}"
    suite, minutes, fast, seconds = found.groups()
    return ReadmeFigures(int(suite.replace(",", "")), 60.0 * int(minutes), int(fast.replace(",", "")), float(seconds))


def off_by(stated: float, measured: float) -> float:
    """How far ``stated`` is from ``measured``, as a share of ``measured``."""
    return abs(stated - measured) / measured if measured else float("inf")
