"""Choosing between mindft's own backend and MindIO TFT (the mindio_ttp wheel is installed here)."""
from __future__ import annotations

import json
from typing import List

import pytest
from click.testing import CliRunner

from mindft.cli.main import main
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


@pytest.mark.mindspore
def test_this_machine_runs_mindio_only_when_asked() -> None:
    from mindft.mindspore._mindio_session import MindioSession
    from mindft.mindspore._session import Session
    from mindft.mindspore.backend import mindio_installed, resolve_backend, session_class

    assert mindio_installed()
    auto = load_config({"MS_ENABLE_TFT": "{UCE:1}"})
    assert resolve_backend(auto) == MINDFT and session_class(auto) is Session
    asked = load_config({"MS_ENABLE_TFT": "{UCE:1}", "MINDFT_BACKEND": "mindio"})
    assert resolve_backend(asked) == MINDIO and session_class(asked) is MindioSession
    off = load_config({"MINDFT_BACKEND": "mindio"})  # fault tolerance off: nothing to coordinate
    assert session_class(off) is Session


@pytest.mark.mindspore
def test_mindio_session_refuses_sparse_snapshots() -> None:
    import mindspore as ms
    from mindspore import nn

    from mindft.mindspore._mindio_session import MindioSession
    from mindft.mindspore._session import TrainingState

    ms.set_device("CPU")
    net = nn.Dense(2, 2)
    config = load_config({"MS_ENABLE_TFT": "{UCE:1}", "MINDFT_BACKEND": "mindio", "MINDFT_SNAPSHOT_EVERY": "3"})
    with pytest.raises(ConfigError, match="MINDFT_SNAPSHOT_EVERY=3: the mindio backend snapshots every step"):
        MindioSession(TrainingState(net), None, config)


@pytest.mark.mindspore  # the check asks MindSpore for the device
def test_config_check_says_which_backend_runs_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    monkeypatch.setenv("MS_ENABLE_TFT", "{UCE:1}")
    monkeypatch.setenv("MINDFT_INSECURE", "1")
    text = runner.invoke(main, ["config", "check"])
    assert text.exit_code == 0, text.output
    assert "backend                          mindft" in text.output
    assert "mindio_ttp is installed but not asked for on CPU" in text.output
    monkeypatch.setenv("MINDFT_BACKEND", "mindio")
    resolved = runner.invoke(main, ["config", "check", "--json"])
    assert resolved.exit_code == 0, resolved.output
    assert json.loads(resolved.output)["backend_choice"] == {"backend": "mindio", "reason": "MINDFT_BACKEND=mindio"}


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
