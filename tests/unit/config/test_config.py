from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

import mindft
from mindft.cli.main import EXIT_CONFIG_ERROR, main
from mindft.config import (DEFAULT_RESET_FILE, ENV_VARS, ConfigError, MindftConfig, TFTOptions,
                           Timeouts, load_config, parse_tft)


@pytest.mark.parametrize("text, expected", [
    ("", TFTOptions()),
    ("{}", TFTOptions()),
    ("   ", TFTOptions()),
    ("{RSC:1}", TFTOptions(rsc=True)),
    ("RSC:1", TFTOptions(rsc=True)),
    ("{TTP:1,UCE:1}", TFTOptions(ttp=True, uce=True)),
    (" { TTP : 1 , UCE:1 } ", TFTOptions(ttp=True, uce=True)),
    ("{TTP:1,TTP:1}", TFTOptions(ttp=True)),
    ("{TTP:0}", TFTOptions()),
    ("{TRE:2}", TFTOptions(tre=2)),
    ("{HCCE:1,TSP:1}", TFTOptions(hcce=True, tsp=True)),
    ("{ATO:1,ATO_PATH:/tmp/ato.json,ATO_THRESHOLD:20}",
     TFTOptions(ato=True, ato_path="/tmp/ato.json", ato_threshold=20)),
])
def test_parse_tft_accepts_what_mindspore_accepts(text: str, expected: TFTOptions) -> None:
    assert parse_tft(text) == expected


def test_arf_implies_ttp_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mindft.config"):
        options = parse_tft("{ARF:1}")
    assert options.arf and options.ttp
    assert "ARF:1 implies TTP:1" in caplog.text


# Each malformed or conflicting input and the words its error must contain.
@pytest.mark.parametrize("text, fragments", [
    ("{TTP}", ["'TTP'", "has no value", "TTP:1"]),
    ("{ttp}", ["'ttp'", "has no value", "'TTP:1'"]),
    ("garbage", ["'garbage'", "is not an option", "KEY:VALUE", "RSC:1"]),
    ("TTP:1,,UCE:1", ["empty item #2", "KEY:VALUE"]),
    ("{TTP:yes}", ["TTP must be one of 0, 1", "'yes'"]),
    ("{ttp:1}", ["unknown option 'ttp'", "did you mean 'TTP'", "known options: ARF"]),
    ("{UCX:1}", ["unknown option 'UCX'", "known options: ARF, ATO, ATO_PATH, ATO_THRESHOLD, HCCE, "
                 "RSC, TRE, TSP, TTP, UCE"]),
    ("{TTP:1,TTP:0}", ["TTP is given twice", "'1' and '0'"]),
    ("{TRE:3}", ["TRE must be one of 0, 1, 2"]),
    ("{RSC:1,ARF:1}", ["RSC (graceful fault tolerance)", "ARF (process-level rescheduling)"]),
    ("{RSC:1,UCE:1}", ["RSC", "UCE (process-level online recovery)"]),
    ("{RSC:1,HCCE:1}", ["RSC", "HCCE (process-level online recovery)"]),
    ("{RSC:1", ["unbalanced braces"]),
    ("{ATO_PATH:/x}", ["only apply with ATO:1"]),
    ("{ATO:1,ATO_THRESHOLD:high}", ["ATO_THRESHOLD must be an integer >= 10", "'high'"]),
    ("{ATO:1,ATO_THRESHOLD:5}", ["ATO_THRESHOLD must be an integer >= 10", "'5'"]),
    ("{ATO:1,ATO_PATH:/tmp/ato.txt}", ["ATO_PATH must be a .json file path"]),
    ("{ATO:1,TTP:1}", ["ATO:1 cannot be combined with TTP"]),
    ("{TTP:}", ["TTP must be one of 0, 1", "''"]),
    (",", ["empty item #1"]),
])
def test_parse_tft_rejects_with_an_actionable_message(text: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_tft(text)
    message = str(caught.value)
    assert message.startswith("MS_ENABLE_TFT: ")
    assert repr(text) in message or "empty item" in message or "braces" in message
    for fragment in fragments:
        assert fragment in message
    assert "garbage:1" not in message
    assert isinstance(caught.value, ValueError)


def test_options_render_back_to_the_variable_syntax() -> None:
    for text in ("{RSC:1}", "{TTP:1,UCE:1}", "{TRE:2}", "{}"):
        assert parse_tft(str(parse_tft(text))) == parse_tft(text)


def test_enabled_and_mindio_requirement_follow_mindspore() -> None:
    assert not parse_tft("").enabled
    assert parse_tft("{RSC:1}").enabled and not parse_tft("{RSC:1}").needs_mindio
    assert parse_tft("{TTP:1}").needs_mindio
    assert parse_tft("{TRE:1}").enabled


def test_load_config_defaults() -> None:
    config = load_config({})
    assert config == MindftConfig()
    assert config.reset_file == DEFAULT_RESET_FILE
    assert config.controller_address == "tcp://127.0.0.1:29600"
    assert config.timeouts.dead_after == pytest.approx(3.0)


def test_load_config_reads_msrun_variables_and_overrides() -> None:
    config = load_config({
        "MS_ENABLE_TFT": "{RSC:1}", "MS_TFT_IP": "10.0.0.5", "MS_TFT_PORT": "4000",
        "RANK_SIZE": "8", "RANK_ID": "7", "MINDFT_RESET_FILE": "/tmp/reset.json",
        "MINDFT_KEY_FILE": "/run/keys.json", "MINDFT_INSECURE": "1", "MINDFT_DUMP_DIR": "/tmp/d",
        "MINDFT_RESTART_COUNT": "2", "MINDFT_HEARTBEAT_INTERVAL": "0.1",
        "MINDFT_HEARTBEAT_MISSES": "3", "MINDFT_REPAIR_TIMEOUT": "30", "MINDFT_SNAPSHOT_EVERY": "4",
        "MINDFT_BACKEND": "mindft",
    })
    assert config.snapshot_every == 4 and config.backend == "mindft"
    assert config.tft.rsc
    assert (config.rank, config.world_size) == (7, 8)
    assert config.controller_address == "tcp://10.0.0.5:4000"
    assert config.reset_file == Path("/tmp/reset.json")
    assert config.key_file == Path("/run/keys.json")
    assert config.insecure and config.restart_count == 2
    assert config.timeouts == Timeouts(heartbeat_interval=0.1, heartbeat_misses=3, repair=30.0)


@pytest.mark.parametrize("environ, fragments", [
    ({"MS_TFT_PORT": "80"}, ["MS_TFT_PORT", "'80'", "1024..65535"]),
    ({"MS_TFT_PORT": "70000"}, ["MS_TFT_PORT", "1024..65535"]),
    ({"MS_TFT_PORT": "http"}, ["MS_TFT_PORT", "expected an integer", "'http'"]),
    ({"MS_WORKER_NUM": "4", "MS_NODE_ID": "4"}, ["MS_NODE_ID", "rank 4", "0..3"]),
    ({"MS_WORKER_NUM": "0"}, ["MS_WORKER_NUM", "out of range"]),
    ({"MS_WORKER_NUM": "4", "RANK_SIZE": "8"}, ["MS_WORKER_NUM='4'", "RANK_SIZE='8'", "disagree"]),
    ({"MS_NODE_ID": "-1"}, ["MS_NODE_ID", "out of range"]),
    ({"MS_TFT_IP": "controller.local"}, ["MS_TFT_IP", "'controller.local'", "not an IP address"]),
    ({"MINDFT_HEARTBEAT_INTERVAL": "fast"}, ["MINDFT_HEARTBEAT_INTERVAL", "expected a number"]),
    ({"MINDFT_PAUSE_TIMEOUT": "0"}, ["MINDFT_PAUSE_TIMEOUT", "1..86400"]),
    ({"MINDFT_CONNECT_RETRIES": "1000"}, ["MINDFT_CONNECT_RETRIES", "1..300"]),
    ({"MINDFT_INSECURE": "yes"}, ["MINDFT_INSECURE", "expected an integer"]),
    ({"MINDFT_SNAPSHOT_EVERY": "0"}, ["MINDFT_SNAPSHOT_EVERY", "1..1000000"]),
    ({"MS_ENABLE_TFT": "{RSC:1,ARF:1}"}, ["MS_ENABLE_TFT", "RSC", "ARF"]),
    ({"MINDFT_RESTART_SCOPE": "node"}, ["MINDFT_RESTART_SCOPE", "'node'", "auto, rank, all"]),
    ({"MINDFT_STALL_TIMEOUT": "0"}, ["MINDFT_STALL_TIMEOUT", "0.1..3600"]),
    ({"MS_WORKER_NUM": "2", "MINDFT_REPLICA_BUDDY": "2"}, ["MINDFT_REPLICA_BUDDY", "-1..1"]),
    ({"MINDFT_AGENT_REPLICATION": "2"}, ["MINDFT_AGENT_REPLICATION", "0..1"]),
    ({"MINDFT_REPLICA_ENDPOINT": "127.0.0.1:5000"}, ["MINDFT_REPLICA_ENDPOINT", "'127.0.0.1:5000'",
                                                     "tcp://HOST:PORT"]),
])
def test_load_config_rejects_bad_environment(environ: dict[str, str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(environ)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_every_variable_load_config_reads_is_documented() -> None:
    import inspect
    source = inspect.getsource(load_config) + inspect.getsource(mindft.config)
    documented = {var.name for var in ENV_VARS}
    for name in ("MS_ENABLE_TFT", "MS_TFT_IP", "MS_TFT_PORT", "MS_WORKER_NUM", "MS_NODE_ID",
                 "MINDFT_RESET_FILE", "MINDFT_KEY_FILE", "MINDFT_INSECURE", "MINDFT_DUMP_DIR",
                 "MINDFT_RESTART_COUNT", "MINDFT_REPAIR_TIMEOUT"):
        assert name in documented and name in source
    readme = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
    if readme.exists():
        text = readme.read_text()
        missing = [name for name in documented if name not in text]
        assert not missing, f"README misses {missing}"


def test_config_check_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    monkeypatch.setenv("MS_ENABLE_TFT", "{RSC:1}")
    result = runner.invoke(main, ["config", "check"])
    assert result.exit_code == 0
    assert "{RSC:1}" in result.output and "tcp://127.0.0.1:29600" in result.output
    result = runner.invoke(main, ["config", "check", "--json"])
    assert json.loads(result.output)["tft"]["rsc"] is True
    monkeypatch.setenv("MS_ENABLE_TFT", "{TTP}")
    result = runner.invoke(main, ["config", "check"])
    assert result.exit_code == EXIT_CONFIG_ERROR
    assert "'TTP' in '{TTP}' has no value" in result.output


def test_public_api_is_small() -> None:
    assert set(mindft.__all__) >= {"ConfigError", "load_config", "parse_tft"}
    assert mindft.config.parse_tft("{TTP:1,UCE:1}") == TFTOptions(ttp=True, uce=True)


def _broken_mindio(tmp_path: Path) -> Path:
    """A mindio_ttp that fails to import, first on PYTHONPATH (as a wheel missing its native library)."""
    package = tmp_path / "site" / "mindio_ttp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('libttp_framework.so: cannot open shared object')\n")
    return package.parent


def test_config_check_refuses_what_the_launcher_refuses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runner = CliRunner()
    for name in ("MINDFT_INSECURE", "MINDFT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MS_ENABLE_TFT", "{RSC:1}")
    monkeypatch.setenv("MINDFT_KEY_FILE", str(tmp_path / "missing.json"))
    result = runner.invoke(main, ["config", "check"])
    assert result.exit_code == EXIT_CONFIG_ERROR
    assert "MINDFT_KEY_FILE" in result.output and "does not exist" in result.output
    monkeypatch.delenv("MINDFT_KEY_FILE")
    monkeypatch.setenv("MINDFT_BACKEND", "mindio")
    monkeypatch.setenv("PYTHONPATH", str(_broken_mindio(tmp_path)))
    result = runner.invoke(main, ["config", "check"])
    assert result.exit_code == EXIT_CONFIG_ERROR
    assert "MINDFT_BACKEND=mindio but the mindio_ttp wheel cannot be imported" in result.output
    assert "libttp_framework.so" in result.output


def test_launcher_refuses_mindio_backend_without_the_wheel(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("print('never started')\n")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "MS_ENABLE_TFT": "{RSC:1}", "MINDFT_BACKEND": "mindio",
           "PYTHONPATH": f"{_broken_mindio(tmp_path)}{os.pathsep}{root}"}
    env.pop("MINDFT_KEY_FILE", None)
    result = subprocess.run([sys.executable, "-m", "mindft.cli.launch", str(script)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == EXIT_CONFIG_ERROR, result.stdout + result.stderr
    assert "mindio_ttp wheel cannot be imported" in result.stderr and "never started" not in result.stdout


def test_readme_does_not_call_mindio_proprietary() -> None:
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert "proprietary" not in readme.lower()
    assert "Apache-2.0" in readme
