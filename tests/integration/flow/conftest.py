"""The slow tier's share of the explorer: it drives the pure tier's simulator and explorer
(tests/unit/flow/sim.py, explore.py), imported from their folder."""
from __future__ import annotations

import sys

from harness import TESTS

sys.path.insert(0, str(TESTS / "unit" / "flow"))
