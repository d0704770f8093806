"""The node agent's memory directories (/dev/shm): marked as their launcher's, and removed by the
next launcher on the host once that launcher is gone; the generated job key lives there too."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mindft.agent.memory import KEY_PREFIX, MEMORY_PREFIX, OWNER_FILE, private_memory, remove_stale_memory


def test_a_dead_launchers_directories_are_removed_a_live_ones_and_unmarked_ones_kept() -> None:
    mine = private_memory(MEMORY_PREFIX)
    (mine / "rank0").mkdir()
    (mine / "rank0" / "slot0").write_bytes(b"x" * 4096)
    # A launcher that was killed: its directories name a process that is gone.
    gone = subprocess.run([sys.executable, "-c", "import os, json, psutil; "
                           "print(json.dumps({'pid': os.getpid(), 'started': psutil.Process().create_time()}))"],
                          capture_output=True, text=True, check=True)
    dead_memory, dead_key = private_memory(MEMORY_PREFIX), private_memory(KEY_PREFIX)
    for directory in (dead_memory, dead_key):
        (directory / OWNER_FILE).write_text(gone.stdout)
    (dead_memory / "slot").write_bytes(b"y" * 8192)
    # The same pid given to another process later is not the launcher that wrote it.
    reused = private_memory(MEMORY_PREFIX)
    owner = json.loads((reused / OWNER_FILE).read_text())
    (reused / OWNER_FILE).write_text(json.dumps({**owner, "started": owner["started"] - 3600}))
    unmarked = Path(str(mine).replace(MEMORY_PREFIX, MEMORY_PREFIX + "old"))
    unmarked.mkdir()
    try:
        removed = dict(remove_stale_memory())
        assert set(removed) == {dead_memory, dead_key, reused}
        assert removed[dead_memory] >= 8192
        assert mine.is_dir() and unmarked.is_dir() and not dead_memory.exists() and not dead_key.exists()
        assert remove_stale_memory() == []
    finally:
        import shutil

        for directory in (mine, unmarked, reused, dead_memory, dead_key):
            shutil.rmtree(directory, ignore_errors=True)
