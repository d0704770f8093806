"""Sizes for people: what the launcher, the agents and the replicas print about bytes held."""
from __future__ import annotations

__all__ = ["size_from_text", "size_text"]

_SIZE_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}


def size_text(nbytes: int) -> str:
    """``nbytes`` for people: 512 B, 1.5 KiB, 96.0 MiB."""
    for unit, scale in _SIZE_UNITS.items():
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def size_from_text(text: str) -> float:
    """The bytes a :func:`size_text` stands for (to the rounding it printed)."""
    number, unit = text.split()
    return float(number) * (1 if unit == "B" else _SIZE_UNITS[unit])
