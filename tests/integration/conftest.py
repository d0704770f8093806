"""Fixtures of the integration tests."""
from __future__ import annotations

from typing import Iterator

import pytest

from harness import Processes


@pytest.fixture
def processes() -> Iterator[Processes]:
    tracker = Processes()
    yield tracker
    tracker.kill_all()
