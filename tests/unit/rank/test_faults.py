"""Classification of exceptions raised inside a step into protocol fault kinds."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mindft.rank.faults import MAX_DETAIL, DeviceFault, classify, describe
from mindft.protocol import FaultKind


@pytest.mark.parametrize("message, kind", [
    ("UCEError: error_code=507054 device memory", FaultKind.UCE),
    ("HBM MULTI BIT ECC error on device 3", FaultKind.UCE),
    ("HBM multi-bit ECC error detected", FaultKind.UCE),
    ("uncorrectable error in on-chip memory", FaultKind.UCE),
    ("Device reset in progress, device 2", FaultKind.DEVICE_RESET),
    ("the chip is being hot reset", FaultKind.DEVICE_RESET),
    ("HCCEError: link broken", FaultKind.COMMUNICATION),
    ("SuspectRemoteError from rank 3", FaultKind.COMMUNICATION),
    ("HCCL timeout: wait for notify", FaultKind.COMMUNICATION),
    ("Ring ReduceScatter wait receiving [1,9] failed.", FaultKind.COMMUNICATION),
    ("UCEError while HCCL was running", FaultKind.UCE),
    ("shapes (3,4) and (5,6) not aligned", FaultKind.USER_ERROR),  # the script's own bug
    ("", FaultKind.USER_ERROR),
])
def test_classify_runtime_error_messages(message: str, kind: FaultKind) -> None:
    assert classify(RuntimeError(message)) is kind


@pytest.mark.parametrize("kind", list(FaultKind))
def test_device_fault_carries_its_kind_and_its_message_agrees(kind: FaultKind) -> None:
    fault = DeviceFault(kind, "injected at step 3")
    assert isinstance(fault, RuntimeError)
    assert classify(fault) is kind
    if kind in (FaultKind.UCE, FaultKind.DEVICE_RESET, FaultKind.COMMUNICATION):
        # A fault re-raised by MindSpore as a plain RuntimeError keeps its kind.
        assert classify(RuntimeError(str(fault))) is kind


def test_classify_follows_chained_causes() -> None:
    try:
        try:
            raise DeviceFault(FaultKind.DEVICE_RESET)
        except DeviceFault as inner:
            raise ValueError("wrapper lost the message") from inner
    except ValueError as outer:
        assert classify(outer) is FaultKind.DEVICE_RESET


def test_describe_is_one_bounded_line() -> None:
    text = describe(RuntimeError("UCEError: bad\nC++ call stack:\n  frame"))
    assert text == "RuntimeError: UCEError: bad"
    assert len(describe(RuntimeError("x" * 5000))) == MAX_DETAIL


def test_faults_module_does_not_import_mindspore() -> None:
    code = "import sys, mindft.rank.faults; assert 'mindspore' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
