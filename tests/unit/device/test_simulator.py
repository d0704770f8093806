"""The device-plugin simulator: the documents it writes and the order of a scripted hot reset."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mindft.device.simulator import device_script, fault_state, process_alive, write_plugin_episode
from mindft.device.resetfile import read_reset_file


def test_fault_state_rejects_unknown_status() -> None:
    with pytest.raises(ValueError, match="unrecovered, recovered, failed, fault"):
        fault_state([0], "broken")


def test_an_episode_raises_retry_time_once_and_a_failure_isolates(tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    write_plugin_episode(path, [3, 1], "unrecovered", 0x80E01801, "reset")
    state = read_reset_file(path)
    assert [entry.rank for entry in state.ranks] == [1, 3] and state.retry_time == 1
    assert state.restart_type == "hotReset"
    write_plugin_episode(path, [3, 1], "failed", 0x80E01801, "reset")
    state = read_reset_file(path)
    assert state.retry_time == 1 and {(e.status, e.policy, e.initial_policy) for e in state.ranks} == \
        {("failed", "isolate", "reset")}


def test_device_script_waits_for_the_chip_to_be_free(tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    told: list[tuple[str, dict[str, Any]]] = []
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        device_script(path, [0], 0.0, 0.0, "recovered", 0x80E01801, "reset",
                      lambda event, **fields: told.append((event, fields)), {0: sleeper.pid}, process_deadline=0.2)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert [event for event, _ in told] == ["unrecovered", "failed"]
    assert told[1][1]["why"] == f"process {sleeper.pid} still on the chip after 0.2 s"
    assert read_reset_file(path).rank(0).status == "failed"
    assert not process_alive(sleeper.pid)
    told.clear()
    device_script(path, [0], 0.0, 0.0, "recovered", 0x80E01801, "reset",
                  lambda event, **fields: told.append((event, fields)), {0: sleeper.pid})
    assert [event for event, _ in told] == ["unrecovered", "process left the chip", "recovered"]
    assert read_reset_file(path).rank(0).status == "recovered"
