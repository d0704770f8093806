"""mindft.mindio without sockets: placement, argument checks, bounded waits, exit codes.

The real wheel and real processes are exercised in tests/integration/mindio/test_mindio_recovery.py.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from mindft.exitcodes import ExitCode
from mindft.mindio import (MindioController, MindioError, MindioExit, MindioRank, RankCallbacks, RecoveryRequested,
                           controller_runs_here, wheel)
from mindft.mindio.rank import REPORT_STATES
from mindft.mindio.wheel import bounded
from mindft.protocol import FaultKind


def callbacks() -> RankCallbacks:
    return RankCallbacks(settle=lambda: None, restore=lambda step, source: None, dump=lambda reason: None)


def test_controller_runs_on_rank_zero_unless_mindcluster_runs_it() -> None:
    assert controller_runs_here(0, {})
    assert not controller_runs_here(1, {})
    assert not controller_runs_here(0, {"MINDX_TASK_ID": "job-7"})
    assert controller_runs_here(0, {"MINDX_TASK_ID": "  "})


@pytest.mark.parametrize("rank, world, replicas, message", [
    (2, 2, None, "rank 2 is not in 0..1"),
    (-1, 2, None, "rank -1 is not in 0..1"),
    (0, 2, [1], "must hold rank 0"),
    (0, 2, [0, 2], "only ranks 0..1"),
])
def test_rank_rejects_bad_placement(rank: int, world: int, replicas, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MindioRank(rank, world, "127.0.0.1", 29700, callbacks(), replica_ranks=replicas)


@pytest.mark.parametrize("world, port, message", [(0, 29700, "world_size"), (2, 80, "1024..65535")])
def test_controller_rejects_bad_arguments(world: int, port: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MindioController(world, "127.0.0.1", port)


def test_hooks_refuse_before_start() -> None:
    rank = MindioRank(0, 2, "127.0.0.1", 29700, callbacks())
    with pytest.raises(MindioError, match="not started"):
        rank.begin_update(1)
    assert rank.close() is True  # nothing to close, returns at once


@pytest.mark.parametrize("kind", [FaultKind.HANG, FaultKind.DEVICE_RESET, FaultKind.PROCESS_DIED, FaultKind.UNKNOWN])
def test_a_rank_reports_to_mindio_only_faults_it_repairs(kind: FaultKind) -> None:
    rank = MindioRank(0, 2, "127.0.0.1", 29700, callbacks())
    with pytest.raises(ValueError, match=f"MindIO takes reports of uce, communication, not {kind.value}"):
        rank.report_fault(kind)
    assert set(REPORT_STATES) == {FaultKind.UCE, FaultKind.COMMUNICATION}


def test_stop_and_exit_orders_surface_in_the_training_thread() -> None:
    rank = MindioRank(0, 2, "127.0.0.1", 29700, callbacks(), exit_grace=0)
    rank.check()
    rank._on_stop(None, None)
    with pytest.raises(RecoveryRequested):
        rank.check()
    rank._on_save_ckpt(5, [], None, None)
    rank._on_exit(None)
    with pytest.raises(MindioExit) as raised:
        rank.check()
    assert raised.value.code == ExitCode.DUMPED and "dying-gasp" in str(raised.value)


def test_failed_dump_exits_with_dump_failed() -> None:
    def dump(reason: str) -> None:
        raise OSError("disk full")

    rank = MindioRank(0, 2, "127.0.0.1", 29700,
                      RankCallbacks(settle=lambda: None, restore=lambda s, r: None, dump=dump), exit_grace=0)
    with pytest.raises(OSError):
        rank._on_save_ckpt(5, [], None, None)
    rank._on_exit(None)
    with pytest.raises(MindioExit) as raised:
        rank.check()
    assert raised.value.code == ExitCode.DUMP_FAILED


def test_repair_restores_only_targets_from_their_source() -> None:
    calls = []
    rank = MindioRank(1, 4, "127.0.0.1", 29700,
                      RankCallbacks(settle=lambda: None, restore=lambda s, r: calls.append((s, r)),
                                    dump=lambda reason: None))
    rank._on_repair(7, True, [1, 3], {"repair_type": 1, "src": [0, 2], "dst": [3, 1]}, None, None)
    rank._on_repair(7, False, [2], {"repair_type": 0, "src": [1], "dst": [2]}, None, None)
    rank._on_rollback(7, None, None)
    assert calls == [(7, 2), (7, None)]


def test_a_failing_handler_is_reported_to_the_training_thread() -> None:
    def restore(step: int, source) -> None:
        raise RuntimeError("snapshot gone")

    rank = MindioRank(0, 2, "127.0.0.1", 29700,
                      RankCallbacks(settle=lambda: None, restore=restore, dump=lambda reason: None))
    with pytest.raises(RuntimeError):
        rank._on_rollback(3, None, None)
    assert isinstance(rank._handler_error, RuntimeError)


def test_bounded_call_abandons_a_hanging_call(monkeypatch: pytest.MonkeyPatch) -> None:
    skips: list = []
    monkeypatch.setattr(wheel, "skip_native_teardown_at_exit", lambda: skips.append(1))
    release = threading.Event()
    started = time.monotonic()
    assert bounded(release.wait, 0.2, "hanging call") is False
    assert time.monotonic() - started < 2
    assert skips == [1]  # the process must not run the wheel's teardown with the call still inside
    release.set()
    assert bounded(lambda: None, 1, "quick call") is True
    assert bounded(lambda: 1 / 0, 1, "failing call") is False


@pytest.mark.parametrize("ending, status", [("sys.exit(7)", 7), ("pass", 0), ("raise RuntimeError('boom')", 1)])
def test_skipping_native_teardown_keeps_the_exit_status_and_the_output(ending: str, status: int) -> None:
    script = ("import logging, sys\n"
              "from mindft.mindio import wheel\n"
              "logging.basicConfig(level=logging.INFO)\n"
              "wheel.skip_native_teardown_at_exit()\n"
              "wheel.skip_native_teardown_at_exit()\n"
              "print('printed before exit')\n"
              "logging.getLogger('t').info('logged before exit')\n"
              f"{ending}\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert done.stdout == "printed before exit\n"
    assert "logged before exit" in done.stderr
