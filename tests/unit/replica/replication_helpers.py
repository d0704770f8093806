"""What the unit tests of replication share: a deadline to poll within, a rank's state of a step,
and its capture into a store (the fixtures: conftest.py beside this file)."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from mindft.snapshot.store import SnapshotStore

DEADLINE = 30.0


def until(condition: Callable[[], object], what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after :data:`DEADLINE` seconds."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def state(step: int) -> dict[str, np.ndarray]:
    """The arrays of a rank's snapshot of ``step`` (different for every step)."""
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((256, 64)).astype(np.float32), "m": np.arange(1000, dtype=np.int64) * step,
            "s": np.asarray(step, dtype=np.float64)}


def capture(store: SnapshotStore, step: int) -> None:
    """Capture :func:`state` of ``step`` into ``store`` and wait for the copy."""
    store.capture(step, state(step), {"step": step})
    store.wait()
