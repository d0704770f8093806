"""A rank that knows nothing of mindft, for launcher tests that need no controller.

Extra variables: PLAIN_EXIT "RANK:CODE" (that rank exits with CODE after PLAIN_SLEEP);
PLAIN_SLEEP seconds each rank runs (default 0); PLAIN_PID_DIR: write pid-<rank> there at start.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

rank = int(os.environ.get("RANK_ID", "0"))
pid_dir = os.environ.get("PLAIN_PID_DIR")
if pid_dir:
    Path(pid_dir, f"pid-{rank}").write_text(str(os.getpid()))
print(f"plain rank {rank} of {os.environ.get('RANK_SIZE')} running", flush=True)
time.sleep(float(os.environ.get("PLAIN_SLEEP", "0")))
failing = os.environ.get("PLAIN_EXIT", "")
if failing and int(failing.split(":")[0]) == rank:
    print(f"plain rank {rank} exits with code {failing.split(':')[1]}", flush=True)
    sys.exit(int(failing.split(":")[1]))
print(f"plain rank {rank} done", flush=True)
