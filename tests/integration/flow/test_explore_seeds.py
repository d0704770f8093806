"""The seeded explorer past the fast tier's first thousand seeds: the other nine thousand random
jobs, fault schedules and interleavings, each checked as tests/unit/flow/test_explore.py says."""
from __future__ import annotations

import logging

import pytest

from explore import SEEDS, check_explored

pytestmark = pytest.mark.slow  # the simulated jobs of nine thousand seeds: a minute of CPU


@pytest.fixture(autouse=True)
def quiet_flow_logs():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def test_seeded_schedules_past_the_first_thousand() -> None:
    check_explored(range(1_000, SEEDS))
