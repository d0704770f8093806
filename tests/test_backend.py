"""Choosing between mindft's own backend and MindIO TTP (mindio-ttp is not installable here)."""
from __future__ import annotations

import pytest

from mindft.config import ConfigError, MindftConfig, load_config, parse_tft
from mindft.mindspore.backend import (MINDFT, MINDIO, choose_backend, mindio_installed,
                                      require_mindft_backend, resolve_backend)

UCE = parse_tft("{UCE:1}")
RSC = parse_tft("{RSC:1}")


@pytest.mark.parametrize("backend, tft, installed, device, expected", [
    ("auto", UCE, False, "CPU", MINDFT),
    ("auto", UCE, True, "CPU", MINDFT),       # MindIO needs Ascend
    ("auto", UCE, True, "Ascend", MINDIO),    # installed, Ascend, and MindSpore runs UCE on it
    ("auto", RSC, True, "Ascend", MINDFT),    # RSC alone does not need mindio-ttp in MindSpore
    ("mindft", UCE, True, "Ascend", MINDFT),  # explicit choice wins
    ("mindio", UCE, True, "Ascend", MINDIO),
])
def test_choose_backend(backend: str, tft, installed: bool, device: str, expected: str) -> None:
    assert choose_backend(MindftConfig(tft=tft, backend=backend), installed, device) == expected


@pytest.mark.parametrize("installed, device, fragment", [
    (False, "Ascend", "mindio_ttp package is not installed"),
    (True, "CPU", "needs an Ascend device"),
])
def test_explicit_mindio_that_cannot_run_is_a_clear_error(installed: bool, device: str,
                                                          fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        choose_backend(MindftConfig(tft=UCE, backend="mindio"), installed, device)


def test_this_machine_runs_mindfts_own_backend() -> None:
    assert not mindio_installed()
    assert resolve_backend(load_config({"MS_ENABLE_TFT": "{UCE:1}"})) == MINDFT
    require_mindft_backend(load_config({"MS_ENABLE_TFT": "{UCE:1}"}), "FaultTolerantLoop")
    with pytest.raises(ConfigError, match="MINDFT_BACKEND=mindio but the mindio_ttp package"):
        resolve_backend(load_config({"MS_ENABLE_TFT": "{UCE:1}", "MINDFT_BACKEND": "mindio"}))


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match="MINDFT_BACKEND: unknown backend 'ttp'; valid: auto, mindft, mindio"):
        load_config({"MINDFT_BACKEND": "ttp"})
