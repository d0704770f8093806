"""The ``mindft`` command: keygen, inject, simulate-device-plugin, status; output and exit codes."""
from __future__ import annotations

import importlib.metadata
import json
import re
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import click
import pytest
import zmq
from click.testing import CliRunner, Result

from mindft.cli.main import EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_UNREACHABLE, controller_endpoint, main
from mindft.config import MindftConfig, Timeouts
from mindft.controller import Controller
from mindft.net.keys import generate_keys, load_keys, secure_client
from mindft.protocol import Register, encode
from mindft.flow.inputs import DeviceFaulty, DeviceRecovered
from mindft.device.simulator import fault_state
from mindft.device.resetfile import read_reset_file, write_reset_file
from mindft.device.watch import ResetWatcher


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in ("MINDFT_JOB_FILE", "MINDFT_KEY_FILE", "MINDFT_INSECURE", "MS_TFT_PORT", "MINDFT_RESET_FILE"):
        monkeypatch.delenv(name, raising=False)
    return CliRunner()


def test_keygen_writes_a_private_loadable_key(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    result = runner.invoke(main, ["keygen", str(path)])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = load_keys(path)
    assert keys.public.decode() in result.output
    again = runner.invoke(main, ["keygen", str(path)])
    assert again.exit_code == EXIT_FAILED and "exists" in again.output
    assert load_keys(path) == keys  # refused: untouched
    forced = runner.invoke(main, ["keygen", "--force", str(path)])
    assert forced.exit_code == 0 and load_keys(path) != keys


def test_inject_hot_reset_writes_the_plugin_format(runner: CliRunner, tmp_path: Path) -> None:
    reset = tmp_path / "config" / "reset.json"
    write_reset_file(reset, fault_state([0], "recovered", retry_time=4))  # another node's record
    result = runner.invoke(main, ["inject", "--rank", "2", "--fault", "hot-reset", "--reset-file", str(reset),
                                  "--no-recover", "--policy", "reset", "--error-code", "0x80E18402"])
    assert result.exit_code == 0, result.output
    assert "rank 2 unrecovered" in result.output
    document = json.loads(reset.read_text())
    entries = {entry["RankId"]: entry for entry in document["RankList"]}
    assert list(entries) == [2]                      # the writing node's ranks only: last writer wins
    assert entries[2]["Status"] == "unrecovered"
    assert entries[2]["Policy"] == "reset" and entries[2]["ErrorCodeHex"] == "80E18402"
    assert entries[2]["ErrorCode"] == []
    assert document["GracefulExit"] == 0 and document["RetryTime"] == 5  # a new episode
    # What a job's watcher makes of it:
    assert ResetWatcher(reset, 0.01).poll() == [DeviceFaulty(2, "0x80E18402", "reset")]


def test_inject_hot_reset_recovers(runner: CliRunner, tmp_path: Path) -> None:
    reset = tmp_path / "reset.json"
    result = runner.invoke(main, ["inject", "--rank", "1", "--fault", "hot-reset", "--reset-file", str(reset),
                                  "--recover-after", "0", "--json"])
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.output.splitlines()]
    assert [(e["event"], e["rank"]) for e in events] == [("unrecovered", 1), ("recovered", 1)]
    assert read_reset_file(reset).rank(1).status == "recovered"


def test_simulate_device_plugin_sequence_drives_a_watcher(runner: CliRunner, tmp_path: Path) -> None:
    reset = tmp_path / "reset.json"
    watcher = ResetWatcher(reset, 0.01)
    seen: list[object] = []
    watcher.start(seen.append)
    try:
        result = runner.invoke(main, ["simulate-device-plugin", "--rank", "3", "--rank", "1",
                                      "--reset-file", str(reset), "--hold", "0.5"])
        assert result.exit_code == 0, result.output
        deadline = time.monotonic() + 5
        while len(seen) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watcher.stop()
    assert seen == [DeviceFaulty(1, "0x80E01801", "restart_request"),
                    DeviceFaulty(3, "0x80E01801", "restart_request"),
                    DeviceRecovered(1), DeviceRecovered(3)]
    assert result.output.splitlines()[0].startswith("device plugin: rank 1 unrecovered")


def test_simulate_failed_outcome(runner: CliRunner, tmp_path: Path) -> None:
    reset = tmp_path / "reset.json"
    result = runner.invoke(main, ["simulate-device-plugin", "--rank", "0", "--reset-file", str(reset),
                                  "--hold", "0", "--outcome", "failed"])
    assert result.exit_code == 0
    assert read_reset_file(reset).rank(0).status == "failed"


def test_bad_error_code_is_a_usage_error(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["simulate-device-plugin", "--rank", "0",
                                  "--reset-file", str(tmp_path / "r.json"),
                                  "--error-code", "oops"])
    assert result.exit_code == 2 and "oops" in result.output


def test_unwritable_reset_file_fails_cleanly(runner: CliRunner, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(main, ["inject", "--rank", "0", "--fault", "hot-reset",
                                  "--reset-file", str(blocker / "reset.json"), "--recover-after", "0"])
    assert result.exit_code == EXIT_FAILED
    assert "cannot write the reset file" in result.output


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[tuple[Controller, Path]]:
    """A real controller for 2 ranks on a free loopback port, with a job key."""
    key_file = tmp_path / "keys.json"
    generate_keys(key_file)
    config = MindftConfig(world_size=2, controller_port=0, key_file=key_file,
                          timeouts=Timeouts(heartbeat_interval=0.1, heartbeat_misses=1000))
    ctl = Controller(config)
    ctl.start()
    try:
        yield ctl, key_file
    finally:
        ctl.stop()


def _job_file(tmp_path: Path, ctl: Controller, key_file: Path) -> Path:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"controller": ctl.endpoint, "key_file": str(key_file), "insecure": False,
                               "reset_file": str(tmp_path / "reset.json")}))
    return job


def test_status_before_registration(runner: CliRunner, tmp_path: Path,
                                    controller: tuple[Controller, Path]) -> None:
    ctl, key_file = controller
    job = _job_file(tmp_path, ctl, key_file)
    result = runner.invoke(main, ["status", "--job", str(job)])
    assert result.exit_code == 0, result.output
    assert "job state: STARTING" in result.output and "no rank has registered" in result.output
    as_json = runner.invoke(main, ["status", "--job", str(job), "--json"])
    assert json.loads(as_json.output)["state"] == "STARTING"


def test_status_table_and_inject_kill_a_registered_rank(runner: CliRunner, tmp_path: Path,
                                                        controller: tuple[Controller, Path]) -> None:
    ctl, key_file = controller
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.linger = 0
        secure_client(sock, load_keys(key_file))
        sock.connect(ctl.endpoint)
        sock.send(encode(Register(rank=1, incarnation=0, pid=victim.pid)))
        job = _job_file(tmp_path, ctl, key_file)
        deadline = time.monotonic() + 10
        while True:
            result = runner.invoke(main, ["status", "--job", str(job), "--json"])
            assert result.exit_code == 0, (result.output, result.exception)
            ranks = json.loads(result.output)["ranks"]
            if ranks or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert ranks[0]["rank"] == 1 and ranks[0]["pid"] == victim.pid and ranks[0]["restarts"] == 0
        table = runner.invoke(main, ["status", "--job", str(job)]).output.splitlines()
        assert table[1].split() == ["RANK", "STATE", "STEP", "LAST", "HEARTBEAT", "RESTARTS", "PID"]
        assert table[2].split()[0] == "1" and table[2].split()[-1] == str(victim.pid)
        missing = runner.invoke(main, ["inject", "--rank", "0", "--fault", "kill", "--job", str(job)])
        assert missing.exit_code == EXIT_FAILED and "no process for rank 0" in missing.output
        error = _json_error(runner.invoke(main, ["inject", "--rank", "0", "--fault", "kill", "--job", str(job),
                                                 "--json"]), EXIT_FAILED)
        assert error["input"] == "--rank" and error["valid"] == "a rank with a process: 1"
        killed = runner.invoke(main, ["inject", "--rank", "1", "--fault", "kill", "--job", str(job)])
        assert killed.exit_code == 0, killed.output
        assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        sock.close(0)
        if victim.poll() is None:
            victim.kill()
            victim.wait()


def test_status_shows_replicas_and_lost_protection(runner: CliRunner, tmp_path: Path,
                                                   controller: tuple[Controller, Path]) -> None:
    from mindft.net.channel import Client
    from mindft.protocol import CostReport, ReplicaReport, StepReport

    ctl, key_file = controller
    keys = load_keys(key_file)
    sockets = []
    try:
        for rank in (0, 1):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            sock.identity = f"rank{rank}.inc0".encode()
            secure_client(sock, keys)
            sock.connect(ctl.endpoint)
            sock.send(encode(Register(rank=rank, incarnation=0, pid=os.getpid())))
            sockets.append(sock)
        client = Client(ctl.endpoint, keys, timeout=5.0)
        deadline = time.monotonic() + 10
        while client.status().state != "NORMAL":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for step in range(1, 7):
            for rank, sock in enumerate(sockets):
                sock.send(encode(StepReport(rank, step)))
        while client.status().step != 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.request(ReplicaReport(node=0, ranks=(0, 1), steps=(3, 6))).ok
        job = _job_file(tmp_path, ctl, key_file)
        table = runner.invoke(main, ["status", "--job", str(job)]).output.splitlines()
        assert table[0].endswith("snapshots: every step (no cost measured yet, budget 1%)")
        sockets[0].send(encode(CostReport(0, 0.2, 0.4)))  # 0.4 s per 0.2 s step: 2% even every 100th step
        while not client.status().over_budget:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        table = runner.invoke(main, ["status", "--job", str(job)]).output.splitlines()
        assert table[0].endswith("snapshots: every 100 steps (~2.0% of a step, budget 1%) OVER BUDGET: "
                                 "MINDFT_MAX_REPLAY_STEPS bounds the cadence")
        assert table[1].split()[-1] == "REPLICA"
        assert table[2].endswith("3 LOST PROTECTION") and table[3].endswith(" 6")
        assert table[4].startswith("LOST PROTECTION: rank 0: the replica on the next node is gone or older than "
                                   "the steps every rank keeps; were its node lost now, the job would end with")
        rows = json.loads(runner.invoke(main, ["status", "--job", str(job), "--json"]).output)["ranks"]
        assert [(r["replicated"], r["replica_lost"]) for r in rows] == [(3, True), (6, False)]
    finally:
        for sock in sockets:
            sock.close(0)


def test_inject_uce_for_unknown_rank_is_refused(runner: CliRunner, tmp_path: Path,
                                                controller: tuple[Controller, Path]) -> None:
    ctl, key_file = controller
    result = runner.invoke(main, ["inject", "--rank", "1", "--fault", "uce", "--job",
                                  str(_job_file(tmp_path, ctl, key_file))])
    assert result.exit_code == EXIT_FAILED
    assert "refused" in result.output and "not registered" in result.output
    answer = runner.invoke(main, ["inject", "--rank", "1", "--fault", "uce", "--json", "--job",
                                  str(_job_file(tmp_path, ctl, key_file))])
    assert answer.exit_code == EXIT_FAILED
    document = json.loads(answer.stdout)
    assert document["ok"] is False and "not registered" in document["error"]


def test_status_with_the_wrong_key_is_unreachable(runner: CliRunner, tmp_path: Path,
                                                  controller: tuple[Controller, Path]) -> None:
    ctl, _ = controller
    other = tmp_path / "other.json"
    generate_keys(other)
    result = runner.invoke(main, ["status", "--address", ctl.endpoint, "--key-file", str(other),
                                  "--timeout", "0.5"])
    assert result.exit_code == EXIT_UNREACHABLE
    assert "no answer" in result.output


def test_status_without_a_controller(runner: CliRunner) -> None:
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    result = runner.invoke(main, ["status", "--address", f"tcp://127.0.0.1:{port}", "--insecure",
                                  "--timeout", "0.3"])
    assert result.exit_code == EXIT_UNREACHABLE


def test_status_accepts_host_port_without_tcp(runner: CliRunner, tmp_path: Path,
                                              controller: tuple[Controller, Path]) -> None:
    ctl, key_file = controller
    host_port = ctl.endpoint[len("tcp://"):]
    result = runner.invoke(main, ["status", "--address", host_port, "--key-file", str(key_file)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "job state: STARTING" in result.output


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", "udp://127.0.0.1:5",
                                     "::1:5", ":5"])
def test_status_with_a_bad_address_is_a_usage_error(runner: CliRunner, address: str) -> None:
    result = runner.invoke(main, ["status", "--address", address, "--insecure", "--timeout", "0.2"])
    assert result.exit_code == EXIT_CONFIG_ERROR, (result.output, result.exception)
    assert f"--address: {address!r} is not a controller address" in result.output
    assert "HOST:PORT" in result.output and result.exception is None or isinstance(result.exception, SystemExit)


def test_controller_endpoint_forms() -> None:
    assert controller_endpoint("127.0.0.1:29600") == "tcp://127.0.0.1:29600"
    assert controller_endpoint(" tcp://node-0:29600 ") == "tcp://node-0:29600"
    assert controller_endpoint("[::1]:29600") == "tcp://[::1]:29600"


def test_status_needs_a_key(runner: CliRunner) -> None:
    result = runner.invoke(main, ["status", "--address", "tcp://127.0.0.1:1"])
    assert result.exit_code == EXIT_CONFIG_ERROR and "no job key" in result.output


def test_bad_job_file(runner: CliRunner, tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text("{}")
    result = runner.invoke(main, ["status", "--job", str(job)])
    assert result.exit_code == EXIT_CONFIG_ERROR and "not a job file" in result.output


def test_config_check_still_works(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MS_ENABLE_TFT", "{RSC:1}")
    assert runner.invoke(main, ["config", "check"]).exit_code == 0
    monkeypatch.setenv("MS_ENABLE_TFT", "{RSC:1,ARF:1}")
    bad = runner.invoke(main, ["config", "check"])
    assert bad.exit_code == EXIT_CONFIG_ERROR and "ARF" in bad.output


def _command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command and group of ``mindft`` as the words that call it (the group itself first)."""
    yield prefix
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _command_paths(command, (*prefix, name))
        else:
            yield (*prefix, name)


def test_dash_h_is_help_everywhere(runner: CliRunner) -> None:
    from mindft.cli.launch import main as launch

    paths = list(_command_paths(main))
    assert ("config", "check") in paths and ("inject",) in paths
    for path in paths:
        result = runner.invoke(main, [*path, "-h"])
        assert result.exit_code == 0 and result.output.startswith("Usage:"), (path, result.output)
        assert result.output == runner.invoke(main, [*path, "--help"]).output, path
    launcher = runner.invoke(launch, ["-h"])
    assert launcher.exit_code == 0 and "Run SCRIPT [ARGS] as NPROC ranks" in launcher.output


def test_version_on_both_commands(runner: CliRunner) -> None:
    from mindft.cli.launch import main as launch

    expected = f"mindft {importlib.metadata.version('mindft')}\n"
    for command in (main, launch):
        result = runner.invoke(command, ["--version"])
        assert (result.exit_code, result.output) == (0, expected), result.output


def _config_table(output: str) -> dict[str, str]:
    rows = {}
    for line in output.splitlines():
        name, _, value = line.partition("  ")
        rows[name.strip()] = value.strip()
    return rows


def test_config_check_prints_values_as_a_user_writes_them(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MINDFT_SNAPSHOT_EVERY", "MINDFT_STATE_DIR", "MINDFT_REPLICA_BUDDY", "MINDFT_REPLICA_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MS_ENABLE_TFT", "{RSC:0}")
    result = runner.invoke(main, ["config", "check"])
    assert result.exit_code == 0, result.output
    rows = _config_table(result.output)
    assert rows["MS_ENABLE_TFT"] == "'{RSC:0}'" and rows["options in effect"] == "-"
    # Rows are named by the variables a user sets; one row per setting.
    assert rows["fault tolerance enabled"] == "no" and rows["MINDFT_INSECURE"] == "no"
    assert rows["MINDFT_WARM_START"] == "yes" and rows["MINDFT_DUMP_DIR"] == "mindft_dump"
    assert rows["MINDFT_KEY_FILE"] == "-" and rows["MINDFT_SNAPSHOT_EVERY"] == "-" and rows["MINDFT_REPLICA_ENDPOINT"] == "-"
    assert rows["MINDFT_REGISTER_TIMEOUT"] == "120" and rows["MINDFT_HEARTBEAT_INTERVAL"] == "0.5"
    assert not [name for name in rows if "_" in name and not name.isupper()], rows  # no internal names (dump_dir)
    assert not {"None", "True", "False", "{}", ""} & set(rows.values()), rows
    monkeypatch.delenv("MS_ENABLE_TFT")
    assert _config_table(runner.invoke(main, ["config", "check"]).output)["MS_ENABLE_TFT"] == "-"
    monkeypatch.setenv("MS_ENABLE_TFT", "{RSC:1}")
    monkeypatch.setenv("MINDFT_INSECURE", "1")
    rows = _config_table(runner.invoke(main, ["config", "check"]).output)
    assert rows["MINDFT_BACKEND"] == "auto" and rows["backend chosen"] == "mindft" and "backend" not in rows


def test_config_check_read_in_part_ends_quietly(tmp_path: Path) -> None:
    """``mindft config check | head -2``: the reader leaving early is no failure."""
    done = subprocess.run(f"{sys.executable} -m mindft.cli.main config check | head -2; exit ${{PIPESTATUS[0]}}",
                          shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 2 and done.stderr == "", done


def test_keygen_refuses_a_directory_that_does_not_exist(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["keygen", str(tmp_path / "nowhere" / "keys.json")])
    assert result.exit_code == EXIT_CONFIG_ERROR and "is not a directory: create it first" in result.output
    assert not (tmp_path / "nowhere").exists()


def _json_commands(group: click.Group = main) -> list[tuple[str, ...]]:
    return [path for path in _command_paths(group) if path and not isinstance(_command(path), click.Group)
            and any("--json" in param.opts for param in _command(path).params)]


def _command(path: tuple[str, ...]) -> click.Command:
    command: click.Command = main
    for word in path:
        assert isinstance(command, click.Group)
        command = command.commands[word]
    return command


def _json_error(result: Result, code: int) -> dict:
    assert result.exit_code == code, result.output
    document = json.loads(result.stdout)
    assert set(document) >= {"error", "exit_code"} and document["exit_code"] == code, document
    return document


def test_every_json_command_answers_a_bad_command_line_in_json(runner: CliRunner) -> None:
    commands = _json_commands()
    assert set(commands) == {("config", "check"), ("status",), ("events",), ("inject",),
                             ("simulate-device-plugin",)}
    for path in commands:
        error = _json_error(runner.invoke(main, [*path, "--bogus", "--json"]), EXIT_CONFIG_ERROR)
        assert error["input"] == "--bogus" and "No such option" in error["error"], (path, error)
    error = _json_error(runner.invoke(main, ["inject", "--rank", "0", "--fault", "zap", "--json"]), EXIT_CONFIG_ERROR)
    assert error["input"] == "--fault" and error["valid"] == "hot-reset, uce, kill, hang"
    error = _json_error(runner.invoke(main, ["inject", "--fault", "uce", "--json"]), EXIT_CONFIG_ERROR)
    assert error["input"] == "--rank"


def test_json_errors_name_the_input_and_what_is_valid(runner: CliRunner, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("MS_ENABLE_TFT", "{RSC:2}")
    error = _json_error(runner.invoke(main, ["config", "check", "--json"]), EXIT_CONFIG_ERROR)
    assert error["input"] == "MS_ENABLE_TFT" and "RSC must be one of 0, 1, got '2'" in error["error"]
    monkeypatch.delenv("MS_ENABLE_TFT")
    error = _json_error(runner.invoke(main, ["status", "--address", "x", "--insecure", "--json"]), EXIT_CONFIG_ERROR)
    assert error["input"] == "--address" and error["valid"] == "HOST:PORT or tcp://HOST:PORT"
    error = _json_error(runner.invoke(main, ["status", "--address", "127.0.0.1:1", "--json"]), EXIT_CONFIG_ERROR)
    assert "no job key" in error["error"] and "--key-file" in error["valid"]
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    error = _json_error(runner.invoke(main, ["status", "--address", f"127.0.0.1:{port}", "--insecure",
                                             "--timeout", "0.2", "--json"]), EXIT_UNREACHABLE)
    assert "no answer" in error["error"]
    missing = tmp_path / "nowhere" / "reset.json"
    for command in (["inject", "--rank", "0", "--fault", "hot-reset"], ["simulate-device-plugin", "--rank", "0"]):
        error = _json_error(runner.invoke(main, [*command, "--reset-file", str(missing), "--json"]), EXIT_CONFIG_ERROR)
        assert error["input"] == "--reset-file" and "does not exist" in error["error"]
    error = _json_error(runner.invoke(main, ["simulate-device-plugin", "--rank", "0", "--error-code", "oops",
                                             "--reset-file", str(tmp_path / "r.json"), "--json"]), EXIT_CONFIG_ERROR)
    assert error["input"] == "--error-code" and "0x80E01801" in error["valid"]
    plain = runner.invoke(main, ["status", "--address", "x", "--insecure"])
    assert plain.exit_code == EXIT_CONFIG_ERROR and plain.stdout == ""
    assert plain.stderr.startswith("mindft: --address: 'x' is not a controller address")


@pytest.mark.parametrize("logger, tag", [
    ("mindft.cli.launch", "mindft-launch"), ("mindft.agent.shell", "mindft-launch"),
    ("mindft.agent.links", "mindft-launch"), ("mindft.agent.takeover", "mindft-launch"),
    ("mindft.controller.shell", "controller"), ("mindft.device.watch", "resetwatch"),
    ("mindft.agent.warm", "warm"), ("mindft.replica.keeper", "keeper"), ("mindft.flow.gasp", "gasp"),
])
def test_the_launchers_lines_keep_their_tags_wherever_the_module_lives(logger: str, tag: str) -> None:
    from mindft.cli.launch import log_tag

    assert log_tag(logger) == tag


def test_status_shows_the_controllers_term_its_standbys_and_the_spares_waiting(
        runner: CliRunner, tmp_path: Path, controller: tuple[Controller, Path]) -> None:
    from mindft.net.channel import Client
    from mindft.protocol import AgentHello

    ctl, key_file = controller
    keys = load_keys(key_file)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    secure_client(sock, keys)
    sock.connect(ctl.endpoint)
    try:
        sock.send(encode(AgentHello(-1, (), spare=True)))
        client = Client(ctl.endpoint, keys, timeout=5.0)
        deadline = time.monotonic() + 10
        while client.status().spares != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        result = runner.invoke(main, ["status", "--address", ctl.endpoint, "--key-file", str(key_file)])
    finally:
        sock.close()
    assert result.exit_code == 0, result.output
    assert "controller: term 0; standbys: none; warm spares waiting: 1" in result.output
    # Still starting: none of it productive (the rest is start-up, shown once it reaches 0.05 s).
    assert re.search(r"^goodput: 0\.0% of [\d.]+ s productive \(0\.0 s\)", result.output, re.MULTILINE), result.output


def _job_dir(tmp_path: Path, reset_file: str, launcher_pid: int = 0) -> Path:
    """A run directory whose job.json is mindft-launch's, for a 2-rank job whose controller is gone."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    key_file = run_dir / "keys.json"
    generate_keys(key_file)
    (run_dir / "job.json").write_text(json.dumps({
        "controller": "tcp://127.0.0.1:1", "key_file": str(key_file), "insecure": False, "reset_file": reset_file,
        "world_size": 2, "node_rank": 0, "launcher_pid": launcher_pid, "ranks": {"0": 0, "1": 0}}))
    return run_dir


def test_inject_never_creates_the_device_plugins_mount_and_refuses_a_rank_the_job_lacks(
        runner: CliRunner, tmp_path: Path) -> None:
    plugin_mount = tmp_path / "user" / "restore" / "reset" / "config" / "reset.json"  # nothing mounted it
    run_dir = _job_dir(tmp_path, str(plugin_mount))
    for job in (run_dir, run_dir / "job.json"):
        refused = runner.invoke(main, ["inject", "--job", str(job), "--rank", "1", "--fault", "hot-reset"])
        assert refused.exit_code == EXIT_CONFIG_ERROR, refused.output
        assert "nothing mounted its directory" in refused.output and "MINDFT_RESET_FILE" in refused.output
    assert not (tmp_path / "user").exists()
    for fault in ("hot-reset", "uce", "kill", "hang"):
        unknown = runner.invoke(main, ["inject", "--job", str(run_dir), "--rank", "5", "--fault", fault,
                                       "--timeout", "0.2"])
        assert unknown.exit_code != 0, (fault, unknown.output)
    unknown = runner.invoke(main, ["inject", "--job", str(run_dir), "--rank", "5", "--fault", "hot-reset"])
    assert unknown.exit_code == EXIT_CONFIG_ERROR and "the job has no rank 5 (its ranks: 0..1)" in unknown.output


def test_status_takes_the_run_directory_and_says_when_the_job_ended_or_its_launcher_is_gone(
        runner: CliRunner, tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = _job_dir(tmp_path, str(tmp_path / "reset.json"), launcher_pid=gone.pid)
    dead = runner.invoke(main, ["status", "--job", str(run_dir), "--timeout", "0.2"])
    assert dead.exit_code == EXIT_UNREACHABLE
    assert f"the launcher that wrote the job file (pid {gone.pid}) is not running" in dead.output
    (run_dir / "job.json").unlink()
    (run_dir / "events.jsonl").write_text("")
    ended = runner.invoke(main, ["status", "--job", str(run_dir)])
    assert ended.exit_code == EXIT_CONFIG_ERROR
    assert f"the job in {run_dir} has ended" in ended.output and f"mindft events --job {run_dir}" in ended.output
