"""The event log of a real job: mindft-launch, 2 ranks of tests/fake_rank.py, a crash."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from harness import FAKE_RANK, Processes, environment

from mindft.observe.events import (CONTROLLER_FILE, FaultSeen, JobFinished, JobMoved, LadderDecision, ProcessExitRecord,
                           ProcessStartRecord, node_file, read)

RANK_SCRIPT = FAKE_RANK
pytestmark = pytest.mark.mindspore  # mindft-launch starts MindSpore's scheduler


def test_a_crash_is_logged_and_mindft_events_shows_its_recovery(tmp_path: Path, processes: Processes) -> None:
    run_dir = tmp_path / "run"
    env = environment(tmp_path, LAUNCH_DIR=str(tmp_path), LAUNCH_STEPS="30", LAUNCH_STEP_TIME="0.02",
                      LAUNCH_CRASH="1:10", MINDFT_HEARTBEAT_INTERVAL="0.1", MINDFT_DUMP_DIR=str(tmp_path / "dump"),
                      MINDFT_REGISTER_TIMEOUT="60", MINDFT_REPAIR_TIMEOUT="30", MS_ENABLE_TFT="{RSC:1}")
    launcher = processes.start([sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--run-dir", str(run_dir),
                                str(RANK_SCRIPT)], env, tmp_path / "launcher.out")
    deadline = time.monotonic() + 60
    while not (run_dir / "job.json").exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Followed while it runs: every event as it is written, the recovery's timeline, until the verdict.
    follow = processes.start([sys.executable, "-m", "mindft.cli.main", "events", "--job", str(run_dir / "job.json"),
                              "--follow"], env, tmp_path / "follow.out")
    assert launcher.wait(90) == 0, (tmp_path / "launcher.out").read_text()[-4000:]
    assert follow.wait(30) == 0
    followed = (tmp_path / "follow.out").read_text()
    assert "NORMAL → PAUSING: rank 1 PROCESS_DIED" in followed and "recovery 1: process_died on rank 1" in followed
    assert "  job finished: exit code 0" in followed.rstrip().splitlines()[-1], followed
    assert not (run_dir / "job.json").exists()  # gone with the job; the event log stays
    assert (run_dir / CONTROLLER_FILE).is_file() and (run_dir / node_file(0)).is_file()

    events = read(run_dir)
    records = [e.record for e in events]
    moves = [(r.from_state, r.to_state) for r in records if isinstance(r, JobMoved)]
    assert moves == [("STARTING", "NORMAL"), ("NORMAL", "PAUSING"), ("PAUSING", "REPAIRING"),
                     ("REPAIRING", "ROLLBACK"), ("ROLLBACK", "RESUMING"), ("RESUMING", "NORMAL"),
                     ("NORMAL", "DONE")]
    (fault,) = [r for r in records if isinstance(r, FaultSeen)]
    assert (fault.rank, fault.fault, fault.step, fault.collateral) == (1, "process_died", 10, False)
    assert [r.rung for r in records if isinstance(r, LadderDecision)] == ["in_place"]
    starts = [(r.role, r.rank, r.restarts) for r in records if isinstance(r, ProcessStartRecord)]
    assert ("worker", 1, 1) in starts and starts.count(("worker", 0, 0)) == 1
    crashed = [r for r in records if isinstance(r, ProcessExitRecord) and r.rank == 1]
    assert crashed[0].code == -9  # the crash: fake_rank SIGKILLs itself
    assert [r.exit_code for r in records if isinstance(r, JobFinished)] == [0]
    assert all(e.source == "controller" for e in events if isinstance(e.record, (JobMoved, FaultSeen)))
    assert all(e.source == "node 0" for e in events if isinstance(e.record, (ProcessStartRecord, ProcessExitRecord)))

    cli = [sys.executable, "-m", "mindft.cli.main", "events", "--job", str(run_dir / "job.json")]
    code, text = processes.run(cli, env, tmp_path / "events.out", timeout=60)
    assert code == 0, text
    lines = text.splitlines()
    assert lines[0].startswith("recovery 1: process_died on rank 1; in place; recovered in ")
    assert sum(line.startswith("recovery ") for line in lines) == 1
    for mark in ("worker exited: rank 1 (killed by signal 9)", "fault: rank 1 process_died at step 10",
                 "every rank paused", "worker started: rank 1", "every rank restored the rollback step",
                 "training resumed"):
        assert any(mark in line for line in lines), (mark, text)
    assert any(line.startswith("  phases: detect ") and "total" in line for line in lines), text
    # The finish, then where the job's wall time went: a crash recovery spends some in repair.
    assert lines[-2].startswith("job finished: exit code 0"), text
    assert re.fullmatch(r"goodput: [\d.]+% of [\d.]+ s productive \([\d.]+ s\); the rest: .*repair [\d.]+ s.*",
                        lines[-1]), text

    code, text = processes.run([*cli, "--json"], env, tmp_path / "events.json", timeout=60)
    assert code == 0, text
    raw = [json.loads(line) for line in text.splitlines()]
    assert len(raw) == len(events) and {"time", "at", "source", "kind", "v"} <= set(raw[0])


def test_a_hot_reset_is_logged_field_by_field(tmp_path: Path, processes: Processes) -> None:
    from mindft.observe.events import OrderSent
    from mindft.device.simulator import fault_state
    from mindft.device.resetfile import write_reset_file

    run_dir, reset = tmp_path / "run", tmp_path / "reset.json"
    env = environment(tmp_path, LAUNCH_DIR=str(tmp_path), LAUNCH_STEPS="60", LAUNCH_STEP_TIME="0.03",
                      MINDFT_HEARTBEAT_INTERVAL="0.1", MINDFT_RESET_POLL_INTERVAL="0.05",
                      MINDFT_RESET_FILE=str(reset), MINDFT_DUMP_DIR=str(tmp_path / "dump"),
                      MINDFT_REGISTER_TIMEOUT="60", MINDFT_REPAIR_TIMEOUT="30", MS_ENABLE_TFT="{RSC:1}")
    launcher = processes.start([sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--no-scheduler",
                                "--run-dir", str(run_dir), str(RANK_SCRIPT)], env, tmp_path / "launcher.out")
    output = tmp_path / "launcher.out"

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + 60
        while text not in output.read_text() and time.monotonic() < deadline:
            assert launcher.poll() is None, output.read_text()[-4000:]
            time.sleep(0.05)
        assert text in output.read_text(), output.read_text()[-4000:]

    wait_for("controller state STARTING → NORMAL")
    time.sleep(0.3)  # some steps of 0.03 s
    began = time.time()
    write_reset_file(reset, fault_state([1], policy="reset"))
    wait_for("rank 1 left its device for a hot reset;")
    write_reset_file(reset, fault_state([1], "recovered", policy="reset"))
    assert launcher.wait(90) == 0, output.read_text()[-4000:]

    events = read(run_dir)
    records = [e.record for e in events]
    assert [e.at for e in events] == sorted(e.at for e in events) and events[0].at < began < events[-1].at
    moves = [r for r in records if isinstance(r, JobMoved)]
    assert [(m.from_state, m.to_state, m.round) for m in moves] == [
        ("STARTING", "NORMAL", 0), ("NORMAL", "PAUSING", 1), ("PAUSING", "REPAIRING", 1),
        ("REPAIRING", "ROLLBACK", 1), ("ROLLBACK", "RESUMING", 1), ("RESUMING", "NORMAL", 1), ("NORMAL", "DONE", 1)]
    assert moves[1].reason.startswith("rank 1 DEVICE_RESET in step ") and moves[-1].step == 60
    (fault,) = [r for r in records if isinstance(r, FaultSeen)]
    assert (fault.rank, fault.fault, fault.node, fault.collateral) == (1, "device_reset", -1, False)
    # The step rank 1 was in: past the slowest rank's (these ranks have no collectives to keep them in
    # lockstep, so rank 1 may be a step or two ahead), and the one the transition names.
    assert fault.step >= moves[1].step + 1 and f"in step {fault.step} " in moves[1].reason
    assert "device plugin: error" in fault.reason
    assert [(r.rung, r.reason) for r in records if isinstance(r, LadderDecision)] == [("in_place", moves[1].reason)]
    (order,) = [r for r in records if isinstance(r, OrderSent)]
    assert (order.rank, order.order, order.restart) == (1, "start", False) and "device was reset" in order.reason
    left = [r for r in records if isinstance(r, ProcessExitRecord) and r.rank == 1]
    assert left[0].code == 6 and left[0].role == "worker"  # LEFT_DEVICE, on the controller's order
    starts = [(r.role, r.rank, r.restarts, r.warm) for r in records if isinstance(r, ProcessStartRecord)]
    assert ("worker", 1, 1, True) in starts  # forked from the warm process, as the first time
    (finish,) = [r for r in records if isinstance(r, JobFinished)]
    assert finish.exit_code == 0 and finish.reason.endswith("1 recovery")
    assert {e.source for e in events} == {"controller", "node 0"}
    for line in (run_dir / CONTROLLER_FILE).read_text().splitlines():
        fields = json.loads(line)
        assert fields["v"] == 1 and fields["time"].endswith("Z") and isinstance(fields["at"], float)
