"""Fixtures of the integration tests."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

from harness import ExampleReferences, Processes

# Modules import helpers from other folders of the tier (dp_jobs, test_launch's launch fixture,
# test_mindio_recovery's require_mindio): every folder is importable, whichever module runs alone.
# Appended, so nothing installed is shadowed.
sys.path.extend(str(folder) for folder in sorted(Path(__file__).resolve().parent.iterdir())
                if folder.is_dir() and not folder.name.startswith("__") and str(folder) not in sys.path)


@pytest.fixture(scope="session")
def example_references(tmp_path_factory: pytest.TempPathFactory) -> ExampleReferences:
    """The examples' fault-free weights, shared by the modules that compare with them."""
    return ExampleReferences(tmp_path_factory.mktemp("example-references"))


@pytest.fixture
def processes() -> Iterator[Processes]:
    tracker = Processes()
    yield tracker
    tracker.kill_all()
