"""A rank with no node agent that replicates its own snapshots, as a MindSpore session does, without MindSpore.

The real Processor, SnapshotStore, Keeper (its buddy's replica) and RankReplication (its own,
to the buddy rank's keeper), wired as ``mindft.mindspore._session.Session`` wires them; the
"model" is a float64 vector to which step ``k`` adds ``k``, so the final state is
``n(n+1)/2`` everywhere iff every rollback restored the right step.

Configured from the environment (load_config plus REPLICA_* variables):
  REPLICA_DIR        directory for the event log ``events-<rank>.jsonl``
  REPLICA_STEPS      steps to train (default 12)
  REPLICA_STEP_TIME  seconds per step (default 0.02)
  REPLICA_FLOATS     size of the state vector (default 262144: 2 MiB)
  REPLICA_HOLD       "STEP": before capturing STEP (first incarnation only), wait until the file
                     ``go-<rank>`` exists in REPLICA_DIR (the test kills the buddy meanwhile)
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np

from mindft.config import load_config
from mindft.exitcodes import ExitCode
from mindft.keys import job_keys
from mindft.processor import Processor
from mindft.protocol import StatusRequest
from mindft.channel import request
from mindft.replica import Keeper, RankReplication, fetch_replica
from mindft.snapshot import SnapshotStore


class Rank:
    """The rank's state and its RankHooks."""

    def __init__(self) -> None:
        self.config = load_config()
        self.rank = self.config.rank
        self.dir = Path(os.environ["REPLICA_DIR"])
        self.steps = int(os.environ.get("REPLICA_STEPS", "12"))
        self.step_time = float(os.environ.get("REPLICA_STEP_TIME", "0.02"))
        hold = os.environ.get("REPLICA_HOLD", "")
        self.hold = int(hold) if hold and not self.config.restart_count else None
        self.state = np.zeros(int(os.environ.get("REPLICA_FLOATS", str(256 * 1024))))
        self.step = 0
        self.keys = job_keys(self.config)
        self.buddy = (self.rank + 1) % self.config.world_size
        self.store = SnapshotStore()
        self.keeper = Keeper(None, "127.0.0.1", self.keys)
        self.processor = Processor(self.config, self.keeper.endpoint, keys=self.keys)
        self.replication: RankReplication | None = None

    def event(self, name: str, **fields: object) -> None:
        record = {"event": name, "rank": self.rank, "incarnation": self.config.restart_count,
                  "step": self.step, "time": time.time(), **fields}
        with open(self.dir / f"events-{self.rank}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def capture(self, step: int) -> None:
        if step == self.hold:
            self.event("holding", before_capture=step)
            while not (self.dir / f"go-{self.rank}").exists():
                time.sleep(0.01)
        seq = self.store.capture(step, {"w": self.state}, {"step": step})
        self.replication.captured(seq, step)
        self.store.wait()
        self.event("captured", captured=step)

    # ---- RankHooks ----

    def settle(self) -> list[int]:
        self.store.wait()
        sender = self.replication.sender
        # What the pause found: is a push to the buddy still unconfirmed, has its timeout expired?
        self.event("settled", held=list(self.store.steps), in_flight=sender.in_flight,
                   push_timeouts=sender.timeouts, unconfirmed=list(self.replication.unconfirmed))
        return list(self.store.steps)

    def restore(self, step: int) -> list[int]:
        self.store.restore(step, into={"w": self.state})
        self.replication.restored(step)
        self.step = step
        self.event("restored")
        return list(self.store.steps)

    def resume(self, step: int) -> None:
        self.event("resumed")

    def arm(self, fault, detail: str) -> None:
        raise AssertionError("no fault is injected into this job")

    def leave_device(self, reason: str) -> NoReturn:
        raise AssertionError("no device is reset in this job")

    def dump_and_exit(self, step: int, reason: str) -> NoReturn:
        self.event("dump", reason=reason)
        self.close()
        sys.exit(ExitCode.DUMPED)

    # ---- training ----

    def adopt(self) -> None:
        """A restarted rank fetches its replica from its buddy's keeper (as Session._adopt_replica)."""
        status = request(self.config.controller_address, self.keys, StatusRequest(), 10.0)
        endpoint = next(r.replica_endpoint for r in status.ranks if r.rank == self.buddy)
        snapshot = fetch_replica(endpoint, self.rank, self.keys, 10.0)
        self.store.adopt(snapshot)
        self.event("adopted", adopted=snapshot.step)

    def run(self) -> None:
        if self.config.restart_count:
            self.adopt()
        self.processor.register(self.store.steps)
        self.replication = RankReplication.attach(self.processor, self.store, self.buddy,
                                                  self.config.timeouts.dead_after, self.keys)
        if self.config.restart_count:
            self.processor.follow(self)
        else:
            self.capture(0)
        while True:
            while self.step < self.steps:
                step = self.step + 1
                time.sleep(self.step_time)
                self.state += step
                self.step = step
                self.processor.end_step(step, self, self.capture)  # a rollback moves self.step back
            if self.processor.finish(self.step, self) is None:
                break
        self.event("done", state=float(self.state[0]), uniform=bool((self.state == self.state[0]).all()))
        self.close()

    def close(self) -> None:
        if self.replication is not None:
            self.replication.close()
        self.processor.close()
        self.store.close()
        self.keeper.close()


if __name__ == "__main__":
    Rank().run()
