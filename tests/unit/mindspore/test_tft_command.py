"""Which command mindft-launch runs for MS_ENABLE_TFT: the options MindSpore runs on MindIO start the
script through mindft.mindspore.mindspore_tft, the others as python would (what that module does:
tests/integration/mindspore/test_mindspore_tft.py)."""
from __future__ import annotations

import sys

import pytest

from harness import FAKE_RANK
from mindft.agent.plan import LaunchSpec, plan_launch
from mindft.cli.launch import main

SCRIPT = FAKE_RANK


def _plan(tft: str, **environ: str) -> LaunchSpec:
    params = main.make_context("mindft-launch", ["--no-scheduler", str(SCRIPT)]).params
    return plan_launch(params, {"MS_ENABLE_TFT": tft, **environ})


@pytest.mark.parametrize("tft", ["{TTP:1}", "{UCE:1}", "{ARF:1}", "{TTP:1,UCE:1}"])
def test_options_mindspore_runs_on_mindio_start_the_script_through_mindft(tft: str) -> None:
    assert _plan(tft).command == (sys.executable, "-m", "mindft.mindspore.mindspore_tft", str(SCRIPT))


@pytest.mark.parametrize("tft", ["{RSC:1}", ""])
def test_other_options_start_the_script_as_python_would(tft: str) -> None:
    assert _plan(tft).command == (sys.executable, str(SCRIPT))
