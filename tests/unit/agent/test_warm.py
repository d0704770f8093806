"""The warm start path: a process forked from the warm process is what a cold start gives, its exit
is reported as Popen reports one, and when the warm process is gone the agent starts cold."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from harness import environment
from mindft.agent.services import start_warm
from mindft.config import ConfigError, load_config
from mindft.agent.plan import LaunchSpec
from mindft.agent.warm import WarmProcess, WarmStarter
from mindft.agent.workers import start_process

PROBE = '''
import json, os, signal, sys
out = {"argv": sys.argv, "orig_argv": sys.orig_argv[1:], "cwd": os.getcwd(), "env": dict(os.environ),
       "path0": sys.path[0], "name": __name__, "file": globals().get("__file__"),
       "signals": {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                   if s not in (signal.SIGKILL, signal.SIGSTOP)},
       "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
       "session_leader": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
       "stdout_line_buffered": sys.stdout.line_buffering, "stdout_write_through": sys.stdout.write_through,
       "stderr_errors": sys.stderr.errors}
print(json.dumps(out))
'''


@pytest.fixture
def warm(tmp_path: Path) -> Iterator[WarmStarter]:
    starter = WarmStarter(environment(PYTHONUNBUFFERED="1"), tmp_path / "warm.log", "json")
    yield starter
    starter.close()


def run(command: tuple[str, ...], env: dict[str, str], warm: WarmStarter | None) -> tuple[object, bytes, int]:
    process = start_process(command, env, None, warm)
    output = process.stdout.read()
    return process, output, process.wait(20)


@pytest.mark.parametrize("form", ["script", "-c", "-m"])
def test_a_forked_process_is_what_a_cold_start_gives(form: str, warm: WarmStarter, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    command = {"script": (sys.executable, "probe.py", "--flag", "x y"),
               "-c": (sys.executable, "-c", PROBE, "--flag"),
               "-m": (sys.executable, "-m", "probe", "--flag")}[form]
    env = environment(PYTHONUNBUFFERED="1", RANK_ID="3")
    warm_process, warm_output, warm_code = run(command, env, warm)
    cold_process, cold_output, cold_code = run(command, env, None)
    assert isinstance(warm_process, WarmProcess) and isinstance(cold_process, subprocess.Popen)
    assert (warm_code, cold_code) == (0, 0)
    assert json.loads(warm_output) == json.loads(cold_output)


def test_exit_codes_and_tracebacks_are_reported_as_popen_reports_them(warm: WarmStarter) -> None:
    env = environment(PYTHONUNBUFFERED="1")
    for code, expected in (("import sys; sys.exit(7)", 7), ("import os; os._exit(6)", 6), ("pass", 0),
                           ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL)):
        assert run((sys.executable, "-c", code), env, warm)[2] == expected, code
    _, output, code = run((sys.executable, "-c", "def user_code():\n    raise ValueError('bad batch')\nuser_code()"),
                          env, warm)
    assert code == 1
    assert b"ValueError: bad batch" in output and b"in user_code" in output


def test_a_forked_process_can_be_killed_and_waited_for(warm: WarmStarter) -> None:
    process = start_process((sys.executable, "-c", "import time; time.sleep(60)"), environment(PYTHONUNBUFFERED="1"),
                            None, warm)
    assert isinstance(process, WarmProcess) and process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.2)
    os.killpg(process.pid, signal.SIGTERM)  # its own session, as a cold start's
    assert process.wait(10) == -signal.SIGTERM
    assert process.poll() == -signal.SIGTERM


def test_an_exit_is_still_reported_after_the_warm_process_died(warm: WarmStarter, tmp_path: Path) -> None:
    go = tmp_path / "go"
    process = start_process((sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(go)!r}): "
                                                   f"time.sleep(0.01)\nos._exit(5)"),
                            environment(PYTHONUNBUFFERED="1"), None, warm)
    assert isinstance(process, WarmProcess)
    os.kill(warm.pid, signal.SIGKILL)
    warm.process.wait(10)
    go.touch()
    assert process.wait(10) == 5


def test_when_the_warm_process_is_gone_processes_start_cold_and_it_is_said_once(
        warm: WarmStarter, caplog: pytest.LogCaptureFixture) -> None:
    env = environment(PYTHONUNBUFFERED="1")
    assert isinstance(run((sys.executable, "-c", "pass"), env, warm)[0], WarmProcess)
    os.kill(warm.pid, signal.SIGKILL)
    warm.process.wait(10)
    with caplog.at_level(logging.WARNING, logger="mindft.agent.warm"):
        started = [run((sys.executable, "-c", "print('cold')"), env, warm) for _ in range(2)]
    assert [(type(p).__name__, out, code) for p, out, code in started] == [("Popen", b"cold\n", 0)] * 2
    assert [r.getMessage() for r in caplog.records if "start cold" in r.getMessage()] == [
        f"warm start process (pid {warm.pid}) failed: it exited with code -9; workers start cold from now on"]
    assert not warm.available and "failed: it exited with code -9" in warm.summary()


def test_a_warm_process_that_dies_while_preloading_leaves_every_start_cold(tmp_path: Path) -> None:
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(3)\n")
    env = environment(PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    starter = WarmStarter(env, tmp_path / "warm.log", "dies_on_import")
    try:
        process, output, code = run((sys.executable, "-c", "print('cold')"), env, starter)
        assert (type(process).__name__, output, code) == ("Popen", b"cold\n", 0)
        assert "exited while importing" in starter.summary()
    finally:
        starter.close()


def test_a_command_a_fork_cannot_become_starts_cold(warm: WarmStarter, tmp_path: Path) -> None:
    env = environment(PYTHONUNBUFFERED="1")
    for command, why in (((sys.executable, "-u", "-c", "pass"), "an interpreter option"),
                         (("/bin/sh", "-c", "exit 0"), "not this interpreter")):
        assert isinstance(start_process(command, env, None, warm), subprocess.Popen), why
    other_seed = environment(PYTHONUNBUFFERED="1", PYTHONHASHSEED="7")
    assert isinstance(start_process((sys.executable, "-c", "pass"), other_seed, None, warm), subprocess.Popen)
    assert warm.forked == 0 and warm.available


def test_the_preloaded_modules_are_loaded_in_a_forked_process(warm: WarmStarter) -> None:
    _, output, _ = run((sys.executable, "-c", "import sys; print('json' in sys.modules)"),
                       environment(PYTHONUNBUFFERED="1"), warm)
    assert output == b"True\n"
    _, output, _ = run((sys.executable, "-c", "import sys; print('json' in sys.modules)"),
                       environment(PYTHONUNBUFFERED="1"), None)
    assert output == b"False\n"


def test_the_switch_and_the_preload_list_are_read_once_with_clear_errors(tmp_path: Path) -> None:
    spec = LaunchSpec(command=(sys.executable, "x.py"), log_dir=tmp_path, env={"MINDFT_WARM_START": "0"})
    assert start_warm(spec) is None
    assert load_config({}).warm_start and load_config({}).preload == "mindspore"
    assert load_config({"MINDFT_PRELOAD": " mindspore, mindformers.core "}).preload == "mindspore,mindformers.core"
    with pytest.raises(ConfigError, match=r"MINDFT_WARM_START: .*2"):
        load_config({"MINDFT_WARM_START": "2"})
    with pytest.raises(ConfigError, match=r"MINDFT_PRELOAD: 'mind-spore' is not a module name"):
        load_config({"MINDFT_PRELOAD": "mind-spore"})


def test_the_idle_warm_process_memory_is_measured(warm: WarmStarter) -> None:
    run((sys.executable, "-c", "pass"), environment(PYTHONUNBUFFERED="1"), warm)
    deadline = time.monotonic() + 5
    while warm.idle_pss is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warm.idle_pss is not None and warm.idle_pss > 1 << 20
    assert "(PSS)" in warm.summary()


def test_a_large_environment_arrives_whole(warm: WarmStarter) -> None:
    big = "x" * 100_000
    _, output, code = run((sys.executable, "-c", "import os; print(len(os.environ['BIG']))"),
                          environment(PYTHONUNBUFFERED="1", BIG=big), warm)
    assert (output, code) == (b"100000\n", 0)


def test_a_forked_worker_shows_its_own_command_line_and_which_process_of_the_job_it_is(warm: WarmStarter) -> None:
    """ps, top and /proc/PID/cmdline show a warm-started rank as a cold start would show it, and
    which rank it is (or that it is MindSpore's scheduler), not the warm process's command line."""
    command = (sys.executable, "-c", "import time; time.sleep(60)")
    shown = {}
    for role, env in (("rank 3", {"RANK_ID": "3", "MS_ROLE": "MS_WORKER"}),
                      ("MindSpore's scheduler", {"MS_ROLE": "MS_SCHED", "RANK_ID": "0"})):
        process = start_process(command, environment(PYTHONUNBUFFERED="1", **env), None, warm)
        try:
            assert isinstance(process, WarmProcess)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                shown[role] = Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                if "[mindft" in shown[role]:
                    break
                time.sleep(0.05)
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        assert shown[role] == f"{' '.join(command)}  [mindft {role}]", shown
    assert "mindft warm process" in Path(f"/proc/{warm.pid}/cmdline").read_bytes().decode(), "the warm process"
