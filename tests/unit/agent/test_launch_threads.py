"""The launcher's side of the controller interface, and threads the launcher must not lose.

Real controller, real processes on loopback; no mocks of the parts under test.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from mindft.config import MindftConfig, Timeouts
from mindft.controller import Controller
from mindft.exitcodes import ExitCode
from mindft.agent.links import ControllerHost
from mindft.agent.plan import LaunchSpec
from mindft.protocol import ProcessExit
from mindft.agent.workers import Console, WorkerProcesses


def _config(world_size: int = 2) -> MindftConfig:
    return MindftConfig(world_size=world_size, controller_port=0, insecure=True,
                        timeouts=Timeouts(heartbeat_interval=0.05, register=60.0))


def test_process_exit_before_registration_fails_the_controller_in_process() -> None:
    controller = Controller(_config())
    controller.start()
    try:
        assert controller.latest_status().state == "STARTING"
        controller.from_local_agent(ProcessExit(1, 7, 4242))
        result = controller.join(10.0)
        assert result is not None and result.exit_code == ExitCode.FAILED
        assert "rank 1 (pid 4242) exited with code 7 before every rank registered" in result.reason
        status = controller.latest_status()  # published by the loop, read from this thread
        assert status.state == "FAILED" and "rank 1" in status.reason
    finally:
        controller.stop(5.0)


class _DyingController(Controller):
    """A real controller whose thread dies of an unexpected error after a moment of service."""

    def start(self) -> threading.Thread:
        def die() -> None:
            time.sleep(0.2)
            raise RuntimeError("controller bug")
        self._dying = threading.Thread(target=die, name="mindft-controller", daemon=True)
        self._dying.start()
        return self._dying


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_runner_notices_a_dead_controller_thread() -> None:
    runner = ControllerHost(_config(), controller_class=_DyingController)
    runner.start()
    try:
        assert runner.poll() is None
        deadline = time.monotonic() + 10.0
        while runner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.result is not None and runner.result.exit_code == ExitCode.FAILED
        assert "controller thread died" in runner.result.reason
    finally:
        runner.stop()


class _BrokenStream:
    """A console whose writes fail with something other than OSError (e.g. a closed GUI pipe wrapper)."""

    def write(self, text: str) -> int:
        raise RuntimeError("console is gone")

    def flush(self) -> None:
        pass


def test_output_pump_survives_a_console_that_fails(tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text("for i in range(2000):\n    print('line', i, 'x' * 200)\nprint('end')\n")
    spec = LaunchSpec(command=(sys.executable, str(script)), nproc=1, run_dir=tmp_path, log_dir=tmp_path / "logs",
                      protected=False)
    workers = WorkerProcesses(spec, Console(stream=_BrokenStream()))  # type: ignore[arg-type]
    workers.start(0, 0)
    worker = workers.workers[0]
    assert worker.process is not None
    try:
        assert worker.process.wait(30) == 0  # a dead pump would leave it blocked on a full pipe
    finally:
        if worker.process.poll() is None:
            worker.process.kill()
    assert worker.pump is not None
    worker.pump.join(10)
    text = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "line 1999" in text and text.rstrip().endswith("end")


@pytest.mark.parametrize("line, shown", [
    (b"[WARNING] RUNTIME_FRAMEWORK(8652,7f4a1f606b80,python):2026-12-07-06:45:36.168.932 [mindspore/ccsrc/x.cc:1] y\n",
     False),
    (b"[WARNING] ME(11900:139771605142400,MainProcess):2026-12-07-06:11:29.624.000 [mindspore/x.py:275] Waiting\n",
     False),
    (b"[INFO] DISTRIBUTED(123,7f00,python):2026-12-07 [x.cc:12] Topology build timed out., retry(1/1200)\n", False),
    (b"[ERROR] ME(1:2,MainProcess):2026-12-07 [x.py:1] Worker process exit with exception\n", True),
    (b"epoch 1 step 3 loss 0.125\n", True),
    (b"Traceback (most recent call last):\n", True),
    (b"[WARNING] something a script printed itself\n", True),
])
def test_mindspores_own_log_lines_go_to_the_log_file_only_unless_asked(line: bytes, shown: bool) -> None:
    from mindft.agent.workers import for_the_console

    assert for_the_console(line, mindspore_logs=False) is shown
    assert for_the_console(line, mindspore_logs=True)
