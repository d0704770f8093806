"""Choosing between mindft's own backend and MindIO TFT: the rules, with the device and the wheel made up
(on this machine, with MindSpore: tests/integration/mindspore/test_backend_on_mindspore.py)."""
from __future__ import annotations

from typing import List

import pytest

from mindft.config import ConfigError, MindftConfig, load_config, parse_tft
from mindft.preflight import ato_failure_rate, choose_backend

MINDFT, MINDIO = "mindft", "mindio"  # mindft.mindspore.backend's names: importing it imports MindSpore
UCE = parse_tft("{UCE:1}")
RSC = parse_tft("{RSC:1}")


def device_of(name: str, asked: List[str]):
    def device() -> str:
        asked.append(name)
        return name
    return device


@pytest.mark.parametrize("backend, tft, installed, device, mindx, expected, because", [
    ("auto", UCE, False, "Ascend", "", MINDFT, "not installed"),
    ("auto", UCE, True, "CPU", "", MINDFT, "not asked for on CPU"),  # mindft implements UCE on CPU itself
    ("auto", UCE, True, "Ascend", "", MINDIO, "on Ascend"),        # MindSpore runs UCE on mindio_ttp there
    ("auto", RSC, True, "Ascend", "", MINDFT, "asks for nothing MindIO runs"),
    ("auto", RSC, True, "CPU", "job-7", MINDIO, "MINDX_TASK_ID set"),  # MindCluster runs MindIO's controller
    ("mindft", UCE, True, "Ascend", "job-7", MINDFT, "MINDFT_BACKEND=mindft"),  # an explicit choice wins
    ("mindio", RSC, True, "CPU", "", MINDIO, "MINDFT_BACKEND=mindio"),
])
def test_choose_backend_and_why(backend: str, tft, installed: bool, device: str, mindx: str, expected: str,
                                because: str) -> None:
    asked: List[str] = []
    choice = choose_backend(MindftConfig(tft=tft, backend=backend), installed, device_of(device, asked),
                            {"MINDX_TASK_ID": mindx} if mindx else {})
    assert (choice.backend, because in choice.reason) == (expected, True), choice
    # The device is asked for only where it decides (importing MindSpore costs seconds).
    assert asked == ([device] if backend == "auto" and installed and not mindx and tft.needs_mindio else [])


def test_explicit_mindio_without_the_wheel_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="MINDFT_BACKEND=mindio but the mindio_ttp package is not installed"):
        choose_backend(MindftConfig(tft=UCE, backend="mindio"), False, lambda: "CPU")


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match="MINDFT_BACKEND: unknown backend 'ttp'; valid: auto, mindft, mindio"):
        load_config({"MINDFT_BACKEND": "ttp"})


@pytest.mark.parametrize("content, tft_text, expected", [
    ('{"failure_count": 12, "total_steps": 600}', "{ATO:1,ATO_PATH:%s}", 0.02),
    ('{"failure_count": 9, "total_steps": 600}', "{ATO:1,ATO_PATH:%s}", 0.0),     # below ATO_THRESHOLD (10)
    ('{"failure_count": 12, "total_steps": 600}', "{ATO:1,ATO_PATH:%s,ATO_THRESHOLD:20}", 0.0),
    ('{"failure_count": 12, "total_steps": 0}', "{ATO:1,ATO_PATH:%s}", 0.0),
    ("not json", "{ATO:1,ATO_PATH:%s}", 0.0),                                     # unreadable: no rate
    (None, "{ATO:1,ATO_PATH:%s}", 0.0),                                           # no file yet
    ('{"failure_count": 12, "total_steps": 600}', "{RSC:1}", 0.0),                # ATO off
])
def test_ato_failure_rate(tmp_path, content, tft_text: str, expected: float) -> None:
    path = tmp_path / "ato_info.json"
    if content is not None:
        path.write_text(content)
    tft = parse_tft(tft_text % path if "%s" in tft_text else tft_text)
    assert ato_failure_rate(tft) == pytest.approx(expected)
