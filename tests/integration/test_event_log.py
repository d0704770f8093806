"""The event log of a real job: mindft-launch, 2 ranks of tests/integration/fake_rank.py, a crash."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from harness import Processes, environment

from mindft.events import (CONTROLLER_FILE, FaultSeen, JobFinished, JobMoved, LadderDecision, ProcessExited,
                           ProcessStarted, node_file, read)

RANK_SCRIPT = Path(__file__).resolve().parent / "fake_rank.py"
pytestmark = pytest.mark.mindspore  # mindft-launch starts MindSpore's scheduler


def test_a_crash_is_logged_and_mindft_events_shows_its_recovery(tmp_path: Path, processes: Processes) -> None:
    run_dir = tmp_path / "run"
    env = environment(tmp_path, LAUNCH_DIR=str(tmp_path), LAUNCH_STEPS="30", LAUNCH_STEP_TIME="0.02",
                      LAUNCH_CRASH="1:10", MINDFT_HEARTBEAT_INTERVAL="0.1", MINDFT_DUMP_DIR=str(tmp_path / "dump"),
                      MINDFT_REGISTER_TIMEOUT="60", MINDFT_REPAIR_TIMEOUT="30", MS_ENABLE_TFT="{RSC:1}")
    launcher = processes.start([sys.executable, "-m", "mindft.launch", "--nproc", "2", "--run-dir", str(run_dir),
                                str(RANK_SCRIPT)], env, tmp_path / "launcher.out")
    deadline = time.monotonic() + 60
    while not (run_dir / "job.json").exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Followed while it runs: every event as it is written, the recovery's timeline, until the verdict.
    follow = processes.start([sys.executable, "-m", "mindft.cli", "events", "--job", str(run_dir / "job.json"),
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
    starts = [(r.role, r.rank, r.restarts) for r in records if isinstance(r, ProcessStarted)]
    assert ("worker", 1, 1) in starts and starts.count(("worker", 0, 0)) == 1
    crashed = [r for r in records if isinstance(r, ProcessExited) and r.rank == 1]
    assert crashed[0].code == -9  # the crash: fake_rank SIGKILLs itself
    assert [r.exit_code for r in records if isinstance(r, JobFinished)] == [0]
    assert all(e.source == "controller" for e in events if isinstance(e.record, (JobMoved, FaultSeen)))
    assert all(e.source == "node 0" for e in events if isinstance(e.record, (ProcessStarted, ProcessExited)))

    cli = [sys.executable, "-m", "mindft.cli", "events", "--job", str(run_dir / "job.json")]
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
    assert lines[-1].startswith("job finished: exit code 0")

    code, text = processes.run([*cli, "--json"], env, tmp_path / "events.json", timeout=60)
    assert code == 0, text
    raw = [json.loads(line) for line in text.splitlines()]
    assert len(raw) == len(events) and {"time", "at", "source", "kind", "v"} <= set(raw[0])
