"""Running a benchmark of bench/ as a user does, for the suite's short forms (tests/integration/bench/)."""
from __future__ import annotations

import os
import subprocess
import sys

from harness import ROOT

# A developer's shell must not configure the benchmark's jobs.
FOREIGN = ("MINDFT_INSECURE", "MINDFT_KEY_FILE", "MS_TFT_PORT", "MS_NODE_ID", "MS_WORKER_NUM", "MINDFT_PRELOAD")


def run_bench(script: str, *args: str, timeout: float = 540) -> str:
    """``python bench/SCRIPT ARGS`` from the repository's root; its stdout (AssertionError unless exit 0)."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
