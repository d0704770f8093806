"""Ranks with no node agent replicate their own snapshots in the background: real processes on 127.0.0.1.

The controller runs on a thread of the test process (CurveZMQ on); every rank is a subprocess
running tests/fake_rank.py: the rank engine's Processor, SnapshotStore, Keeper and
RankReplication, wired as the MindSpore session wires them.
"""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from mindft.config import Timeouts
from mindft.exitcodes import ExitCode

from harness import FAKE_RANK, ControllerJob

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RANK_SCRIPT = FAKE_RANK
DEADLINE = 60.0
# A rank silent for 2 s is dead; a push unconfirmed for 10 s (mindft.replica.sender.ACK_TIMEOUT) is dropped.
TIMEOUTS = Timeouts(heartbeat_interval=0.05, heartbeat_misses=40, register=30.0, pause=20.0,
                    repair=60.0, rollback=20.0, resume=20.0, connect_retries=5)
STEPS = 12


class Job(ControllerJob):
    """A controller thread (CurveZMQ on) plus fake_rank.py subprocesses."""

    def __init__(self, tmp: Path, world_size: int = 2) -> None:
        super().__init__(tmp, world_size, TIMEOUTS, secure=True)

    def spawn(self, rank: int, restart_count: int = 0, **extra: str) -> subprocess.Popen:
        t = TIMEOUTS
        env = self.rank_environment(rank, restart_count, MS_ENABLE_TFT="{RSC:1}",
                                    MINDFT_REGISTER_TIMEOUT=str(t.register),
                                    MINDFT_CONNECT_RETRIES=str(t.connect_retries), MINDFT_SNAPSHOT_EVERY="1",
                                    REPLICA_DIR=str(self.tmp), REPLICA_STEPS=str(STEPS), **extra)
        return self.start([str(RANK_SCRIPT)], env, self.tmp / f"stderr-{rank}.{restart_count}.txt")

    def events(self, rank: int) -> list[dict]:
        path = self.tmp / f"events-{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, predicate: Callable[[], object], what: str) -> None:
        super().wait_for(predicate, what, DEADLINE, every=0.05)


@pytest.fixture
def job(tmp_path: Path):
    made = Job(tmp_path)
    yield made
    made.cleanup()


def test_a_dead_buddy_does_not_delay_the_pause_and_the_killed_rank_comes_back_from_its_replica(job: Job) -> None:
    """Rank 1 (rank 0's buddy, holding rank 0's replica) is killed before rank 0 captures step 5:
    that push can never be confirmed. Rank 0 still pauses (and acknowledges) with the push in
    flight and its timeout not expired; its lost protection shows in the status; rank 1,
    started again, adopts its replica from rank 0 and the job ends with every state right."""
    rank0 = job.spawn(0, REPLICA_HOLD="5")
    rank1 = job.spawn(1)
    job.wait_for(lambda: any(e["event"] == "holding" for e in job.events(0)), "rank 0 to hold before step 5")
    job.wait_for(lambda: any(e["event"] == "captured" and e["captured"] == 4 for e in job.events(1)),
                 "rank 1 to capture step 4")
    rank1.send_signal(signal.SIGKILL)
    assert rank1.wait(10) == -signal.SIGKILL
    (job.tmp / "go-0").write_text("")

    job.wait_for(lambda: any(e["event"] == "settled" for e in job.events(0)), "rank 0 to pause")
    settled = next(e for e in job.events(0) if e["event"] == "settled")
    # The pause found the push of step 5 to the dead buddy unconfirmed and did not wait for it.
    assert settled["in_flight"] == [0, 5] and settled["push_timeouts"] == 0, settled
    # (Rank 0 may have captured step 6 too: once its protection counts as lost its reports go on.)
    assert 5 in settled["unconfirmed"] and 5 in settled["held"], settled
    job.wait_for(lambda: any(r.rank == 0 and r.replica_lost for r in job.status().ranks),
                 "rank 0's lost protection in the status")

    restarted = job.spawn(1, restart_count=1)
    assert rank0.wait(DEADLINE) == ExitCode.OK, job.tail()
    assert restarted.wait(DEADLINE) == ExitCode.OK, job.tail()
    result = job.controller.join(30)
    assert result is not None and result.exit_code == ExitCode.OK, result
    adopted = next(e for e in job.events(1) if e["event"] == "adopted")["adopted"]
    restored = {e["rank"]: e["step"] for r in (0, 1) for e in job.events(r) if e["event"] == "restored"}
    assert adopted in (4, 5) and restored == {0: adopted, 1: adopted}, (adopted, restored)
    for rank in (0, 1):
        done = [e for e in job.events(rank) if e["event"] == "done"][-1]
        assert done["uniform"] and done["state"] == STEPS * (STEPS + 1) / 2, done
    stderr0 = (job.tmp / "stderr-0.0.txt").read_text()
    assert "rank=0 LOST PROTECTION" in stderr0 and "rank=0 protection restored" in stderr0, stderr0


def test_the_status_shows_each_ranks_replicated_step(job: Job) -> None:
    """No fault: each rank's replica on its buddy follows its captures and the status shows it
    (rank 0 holds before capturing step 6 so the job is still running when the test looks)."""
    procs = [job.spawn(0, REPLICA_HOLD="6"), job.spawn(1)]
    job.wait_for(lambda: any(e["event"] == "holding" for e in job.events(0)), "rank 0 to hold before step 6")
    # Rank 0 passed its window for step 6: every rank reported step 5, so every replica holds it
    # (the status hears of it within a report interval).
    job.wait_for(lambda: [(r.rank, r.replicated >= 5) for r in job.status().ranks] == [(0, True), (1, True)],
                 "replicated steps in the status")
    assert not any(r.replica_lost for r in job.status().ranks)
    (job.tmp / "go-0").write_text("")
    for proc in procs:
        assert proc.wait(DEADLINE) == ExitCode.OK, job.tail()
    result = job.controller.join(30)
    assert result is not None and result.exit_code == ExitCode.OK, result
    assert "LOST PROTECTION" not in job.tail()
