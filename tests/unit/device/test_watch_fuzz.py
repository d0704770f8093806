"""A seeded fuzzer over the reset file's structure: depth, sizes, types, encodings, truncation, noise
(tests/reset_garbage.py).

Each input either parses or is a :class:`ResetFileError`; nothing else escapes. The real
watcher thread under bursts of such files: tests/integration/device/test_watch_bursts.py.
"""
from __future__ import annotations

import random

from reset_garbage import SEED, garbage

from mindft.device.resetfile import ResetFileError, ResetState, parse_reset
from mindft.device.watch import _diff_states


def test_parser_accepts_or_rejects_cleanly() -> None:
    """Every input parses or raises ResetFileError; the event diff never raises on what parses."""
    rng = random.Random(SEED)
    parsed = rejected = 0
    seen = None
    for _ in range(4000):
        data = garbage(rng)
        try:
            state = parse_reset(data)
        except ResetFileError as error:
            assert error.kind and str(error)
            rejected += 1
            continue
        assert isinstance(state, ResetState)
        assert all(0 <= entry.rank < 1 << 31 for entry in state.ranks)
        seen, _ = _diff_states(seen, state)
        parsed += 1
    assert parsed > 300 and rejected > 2000   # both sides of the parser were exercised
