"""Fixtures of the replication unit tests: the job's key pair, and the parts a test opened, all closed."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest

from mindft.net.keys import generate_keys


@pytest.fixture
def keys(tmp_path: Path):
    return generate_keys(tmp_path / "keys.json")


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[list]:
    """Closes what a test opened, even when it fails (no thread outlives a test)."""
    opened: list = []
    yield opened
    for part in reversed(opened):
        part.close()
    assert not [t for t in threading.enumerate() if t.name in ("mindft-replication", "mindft-keeper", "mindft-spill")]
