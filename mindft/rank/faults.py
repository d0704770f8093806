"""Device faults as exceptions, and the classification of exceptions into :class:`FaultKind`.

MindSpore reports device errors as ``RuntimeError`` whose message carries the cause
(MindSpore 2.10's own fault-tolerance wrapper looks for ``UCEError``, ``HCCEError``,
``SuspectRemoteError`` ... in ``str(e)``). :func:`classify` does the same, without
importing mindspore, so the adapter can tell the controller what went wrong.
"""
from __future__ import annotations

import re

from mindft.protocol import FaultKind

__all__ = ["DeviceFault", "classify", "describe"]

# Detail strings go over the wire in a FaultReport; keep them to one short line.
MAX_DETAIL = 500

# Checked in order: a UCE message that also mentions HCCL is still a memory error.
_PATTERNS: tuple[tuple[FaultKind, re.Pattern[str]], ...] = (
    (FaultKind.UCE, re.compile(
        r"UCEError|UCE[ _]ERROR|uncorrectable|HBM[ _]MULTI[ _-]?BIT[ _]ECC|multi[ _-]?bit ECC"
        r"|error_code=507054", re.IGNORECASE)),
    (FaultKind.DEVICE_RESET, re.compile(
        r"device[ _-]?reset|hot[ _-]?reset|device (?:is )?(?:lost|unavailable)", re.IGNORECASE)),
    (FaultKind.COMMUNICATION, re.compile(
        r"HCCEError|SuspectRemoteError|\bHCCL\b|\bHCCS\b|communicat|collective"
        r"|AllReduce|ReduceScatter|AllGather|link (?:down|fail)", re.IGNORECASE)),
)


class DeviceFault(RuntimeError):
    """A device fault raised inside a training step (by fault injection, or by a device hook).

    The message starts with the kind's MindSpore-style name so that :func:`classify`
    gives the same answer for ``str(fault)`` as for the exception itself.
    """

    def __init__(self, kind: FaultKind = FaultKind.UCE, detail: str = "") -> None:
        self.kind = FaultKind(kind)
        self.detail = detail
        label = {FaultKind.UCE: "UCEError", FaultKind.DEVICE_RESET: "device reset",
                 FaultKind.COMMUNICATION: "HCCEError"}.get(self.kind, self.kind.value)
        super().__init__(f"{label}: {detail}" if detail else label)


def classify(error: BaseException) -> FaultKind:
    """Map an exception raised inside a step to the :class:`FaultKind` reported to the controller.

    :class:`DeviceFault` carries its kind; any other exception is classified by its
    message (and its chained causes); what matches nothing is the training script's own error
    (``USER_ERROR``), as MindSpore's fault tolerance re-raises what it does not recognise.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DeviceFault):
            return current.kind
        text = f"{type(current).__name__}: {current}"
        for kind, pattern in _PATTERNS:
            if pattern.search(text):
                return kind
        current = current.__cause__ or current.__context__
    return FaultKind.USER_ERROR


def describe(error: BaseException) -> str:
    """A one-line description of ``error`` short enough for a FaultReport."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= MAX_DETAIL else text[:MAX_DETAIL - 3] + "..."
