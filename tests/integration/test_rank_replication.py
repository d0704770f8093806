"""Ranks with no node agent replicate their own snapshots in the background: real processes on 127.0.0.1.

The controller runs on a thread of the test process (CurveZMQ on); every rank is a subprocess
running tests/integration/fake_rank.py: the rank engine's Processor, SnapshotStore, Keeper and
RankReplication, wired as the MindSpore session wires them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from mindft import channel
from mindft.config import MindftConfig, Timeouts
from mindft.controller import Controller
from mindft.exitcodes import ExitCode
from mindft.keys import generate_keys, load_keys
from mindft.protocol import StatusReply, StatusRequest

from launched import end_job

pytestmark = pytest.mark.timeout(180)

RANK_SCRIPT = Path(__file__).with_name("fake_rank.py")
DEADLINE = 60.0
# A rank silent for 2 s is dead; a push unconfirmed for 10 s (mindft.replica.sender.ACK_TIMEOUT) is dropped.
TIMEOUTS = Timeouts(heartbeat_interval=0.05, heartbeat_misses=40, register=30.0, pause=20.0,
                    repair=60.0, rollback=20.0, resume=20.0, connect_retries=5)
STEPS = 12


class Job:
    """A controller thread plus rank subprocesses; :meth:`cleanup` kills whatever is left."""

    def __init__(self, tmp: Path, world_size: int = 2) -> None:
        self.tmp, self.world_size = tmp, world_size
        self.key_file = tmp / "job.key"
        generate_keys(self.key_file)
        config = MindftConfig(world_size=world_size, controller_port=0, key_file=self.key_file, timeouts=TIMEOUTS)
        self.controller = Controller(config)
        self.port = int(self.controller.endpoint.rsplit(":", 1)[1])
        self.config = dataclasses.replace(config, controller_port=self.port)
        self.procs: list[subprocess.Popen] = []
        self.controller.start()

    def spawn(self, rank: int, restart_count: int = 0, **extra: str) -> subprocess.Popen:
        t = TIMEOUTS
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "MINDFT_"))}
        env.update(MS_ENABLE_TFT="{RSC:1}", MS_WORKER_NUM=str(self.world_size), MS_NODE_ID=str(rank),
                   MS_TFT_IP="127.0.0.1", MS_TFT_PORT=str(self.port), MINDFT_RESTART_COUNT=str(restart_count),
                   MINDFT_HEARTBEAT_INTERVAL=str(t.heartbeat_interval),
                   MINDFT_HEARTBEAT_MISSES=str(t.heartbeat_misses), MINDFT_REGISTER_TIMEOUT=str(t.register),
                   MINDFT_CONNECT_RETRIES=str(t.connect_retries), MINDFT_KEY_FILE=str(self.key_file),
                   MINDFT_SNAPSHOT_EVERY="1", REPLICA_DIR=str(self.tmp), REPLICA_STEPS=str(STEPS), **extra)
        proc = subprocess.Popen([sys.executable, str(RANK_SCRIPT)], env=env, cwd=self.tmp,
                                stdout=subprocess.DEVNULL,
                                stderr=open(self.tmp / f"stderr-{rank}.{restart_count}.txt", "ab"))
        self.procs.append(proc)
        return proc

    def events(self, rank: int) -> list[dict]:
        path = self.tmp / f"events-{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def status(self) -> StatusReply:
        reply = channel.request(self.config.controller_address, load_keys(self.key_file), StatusRequest(), 5.0)
        assert isinstance(reply, StatusReply)
        return reply

    def wait_for(self, predicate: Callable[[], object], what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not predicate():
            assert time.monotonic() < deadline, f"gave up waiting for {what}; stderr:\n{self.stderr()}"
            time.sleep(0.05)

    def stderr(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("stderr-*.txt")))

    def cleanup(self) -> None:
        end_job(self.procs, self.controller)


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
    assert rank0.wait(DEADLINE) == ExitCode.OK, job.stderr()
    assert restarted.wait(DEADLINE) == ExitCode.OK, job.stderr()
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
        assert proc.wait(DEADLINE) == ExitCode.OK, job.stderr()
    result = job.controller.join(30)
    assert result is not None and result.exit_code == ExitCode.OK, result
    assert "LOST PROTECTION" not in job.stderr()
