"""Choosing the backend on this machine, where MindSpore answers for the device and the mindio_ttp
wheel is installed (the choice's rules: tests/unit/mindspore/test_backend.py)."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from mindft.cli.main import main
from mindft.config import ConfigError, load_config

pytestmark = pytest.mark.mindspore

MINDFT, MINDIO = "mindft", "mindio"


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


def test_config_check_says_which_backend_runs_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    monkeypatch.setenv("MS_ENABLE_TFT", "{UCE:1}")
    monkeypatch.setenv("MINDFT_INSECURE", "1")
    text = runner.invoke(main, ["config", "check"])
    assert text.exit_code == 0, text.output
    assert re.search(r"^backend chosen +mindft$", text.output, re.MULTILINE), text.output
    assert "mindio_ttp is installed but not asked for on CPU" in text.output
    monkeypatch.setenv("MINDFT_BACKEND", "mindio")
    resolved = runner.invoke(main, ["config", "check", "--json"])
    assert resolved.exit_code == 0, resolved.output
    assert json.loads(resolved.output)["backend_choice"] == {"backend": "mindio", "reason": "MINDFT_BACKEND=mindio"}
