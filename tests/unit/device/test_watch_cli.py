"""`mindft simulate-device-plugin` / `inject --fault hot-reset` write the reset file as the plugin does."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from plugin_files import INITIAL, HostPathMount, KubeletMount, check_code, plugin_episode

from mindft.cli.main import main
from mindft.flow.inputs import DeviceFailed, DeviceFaulty, DeviceRecovered
from mindft.device.watch import ResetWatcher

GO_KEYS = ["RankList", "UpdateTime", "RetryTime", "FaultFlushing", "GracefulExit", "RestartFaultProcess"]


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in ("MINDFT_JOB_FILE", "MINDFT_RESET_FILE"):
        monkeypatch.delenv(name, raising=False)
    return CliRunner()


def _simulate(runner: CliRunner, path: Path, *args: str) -> None:
    result = runner.invoke(main, ["simulate-device-plugin", "--reset-file", str(path), "--hold", "0", *args])
    assert result.exit_code == 0, result.output


def _without_update_time(data: bytes) -> dict[str, object]:
    document = json.loads(data)
    document.pop("UpdateTime")
    return document


def test_bytes_are_the_plugins_bytes_on_a_host_path(runner: CliRunner, tmp_path: Path) -> None:
    mount = HostPathMount(tmp_path / "default.reset-config-job")
    mount.write(INITIAL)
    _simulate(runner, mount.path, "--rank", "3", "--rank", "1", "--outcome", "none", "--policy", "reset",
              "--error-code", "0x8C03A000")
    written = mount.path.read_bytes()
    expected = plugin_episode([1, 3], "unrecovered", "reset", retry_time=1, codes=(0x8C03A000,))
    assert list(json.loads(written)) == GO_KEYS
    assert written[:written.index(b',"UpdateTime":')] == expected[:expected.index(b',"UpdateTime":')]
    assert _without_update_time(written) == _without_update_time(expected)  # the clock apart
    assert b" " not in written and not written.endswith(b"\n")
    assert (mount.directory / "restartType").read_text() == "hotReset"


def test_each_fault_is_a_new_episode_and_the_outcome_keeps_it(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    watcher = ResetWatcher(path, 0.01)
    _simulate(runner, path, "--rank", "0", "--outcome", "none")
    assert json.loads(path.read_bytes())["RetryTime"] == 1
    assert watcher.poll() == [DeviceFaulty(0, "0x80E01801", "restart_request")]
    _simulate(runner, path, "--rank", "0")                      # unrecovered (episode 2), then recovered
    document = json.loads(path.read_bytes())
    assert document["RetryTime"] == 2
    assert [(e["RankId"], e["Status"]) for e in document["RankList"]] == [(0, "recovered")]
    assert watcher.poll() == [DeviceRecovered(0)]


def test_a_second_node_replaces_the_list_and_the_first_stays_faulty(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    watcher = ResetWatcher(path, 0.01)
    _simulate(runner, path, "--rank", "0", "--rank", "1", "--outcome", "none")
    watcher.poll()
    _simulate(runner, path, "--rank", "8", "--outcome", "none")
    assert [e["RankId"] for e in json.loads(path.read_bytes())["RankList"]] == [8]
    assert watcher.poll() == [DeviceFaulty(8, "0x80E01801", "restart_request")]
    assert watcher.faulty_ranks == (0, 1, 8)


def test_a_failed_reset_is_written_isolate(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    _simulate(runner, path, "--rank", "2", "--outcome", "failed", "--policy", "reset")
    [entry] = json.loads(path.read_bytes())["RankList"]
    assert (entry["Status"], entry["Policy"], entry["InitialPolicy"]) == ("failed", "isolate", "reset")
    [event] = ResetWatcher(path, 0.01).poll()
    assert isinstance(event, DeviceFailed) and event.rank == 2


def test_a_kubelet_volume_is_swapped_atomically_with_a_check_code(runner: CliRunner, tmp_path: Path) -> None:
    volume = KubeletMount(tmp_path / "config")
    first = volume.publish(INITIAL, restart_type="podReschedule")
    watcher = ResetWatcher(volume.path, 0.01)
    assert watcher.poll() == []
    result = runner.invoke(main, ["inject", "--rank", "1", "--fault", "hot-reset", "--reset-file", str(volume.path),
                                  "--no-recover", "--policy", "reset"])
    assert result.exit_code == 0, result.output
    assert volume.path.is_symlink() and not first.exists()
    data = volume.path.read_bytes()
    assert (volume.directory / "checkCode").read_text() == check_code(data)
    assert (volume.directory / "restartType").read_text() == "hotReset"
    assert watcher.poll() == [DeviceFaulty(1, "0x80E01801", "reset")]


def _job_file(tmp_path: Path, pids: dict[int, int]) -> Path:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"controller": "tcp://127.0.0.1:1", "reset_file": str(tmp_path / "reset.json"),
                               "ranks": {str(rank): pid for rank, pid in pids.items()}}))
    return job


def test_the_simulated_plugin_resets_a_chip_only_after_its_process_left(tmp_path: Path) -> None:
    leaving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        result = CliRunner().invoke(main, ["simulate-device-plugin", "--rank", "1", "--job",
                                           str(_job_file(tmp_path, {0: 1, 1: leaving.pid})),
                                           "--hold", "0", "--json"])
    finally:
        leaving.wait(10)
    assert result.exit_code == 0, result.output
    events = [json.loads(line)["event"] for line in result.output.splitlines()]
    assert events == ["unrecovered", "process left the chip", "recovered"]
    assert json.loads((tmp_path / "reset.json").read_text())["RankList"][0]["Status"] == "recovered"


def test_the_simulated_plugin_isolates_a_chip_whose_process_stays(tmp_path: Path) -> None:
    staying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        result = CliRunner().invoke(main, ["simulate-device-plugin", "--rank", "1", "--job",
                                           str(_job_file(tmp_path, {1: staying.pid})), "--hold", "0",
                                           "--process-deadline", "0.5", "--json"])
    finally:
        staying.kill()
        staying.wait(10)
    assert result.exit_code == 0, result.output
    last = json.loads(result.output.splitlines()[-1])
    assert last["event"] == "failed" and last["policy"] == "isolate" and "still on the chip" in last["why"]
    entry = json.loads((tmp_path / "reset.json").read_text())["RankList"][0]
    assert (entry["Status"], entry["Policy"]) == ("failed", "isolate")
