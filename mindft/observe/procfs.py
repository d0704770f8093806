"""What Linux's /proc says of a process mindft watches: its memory (the warm process's, a node
metric and a line in the agent's log)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

__all__ = ["proportional_set_size"]


def proportional_set_size(pid: int) -> Optional[int]:
    """A process's PSS in bytes (its share of the pages it maps), None where Linux does not say."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
