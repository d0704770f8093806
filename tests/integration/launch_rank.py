"""A small training rank for the launcher tests: the real Processor and recovery flow, no MindSpore.

Started by ``mindft-launch`` (it reads the environment the launcher sets). Extra variables:
  LAUNCH_DIR        shared directory: buddy replicas, final weights, markers
  LAUNCH_STEPS      steps to train (default 30)
  LAUNCH_STEP_TIME  seconds per step (default 0.02)
  LAUNCH_CRASH      "RANK:STEP": that rank SIGKILLs itself inside STEP, once per job
  LAUNCH_CRASH_ALWAYS  "RANK": that rank exits with code 7 at step 2 in every incarnation
  LAUNCH_IGNORE_TERM   "1": ignore SIGTERM (the launcher must escalate to SIGKILL)
  LAUNCH_GIVE_UP    "RANK:STEP": that rank exits 3 (as after its own dying gasp) inside STEP
  LAUNCH_NO_FILE_REPLICA  "1": a restarted rank finds its state only in its node agent's memory
  LAUNCH_DATA_PARALLEL    "1": every rank's weights are the same, as data-parallel ranks' are

The "weights" are a float64 vector updated by a non-linear, step-dependent rule, so
the final bytes equal :func:`reference` only if every rollback restored exactly the
right step. Each snapshot in the node agent's memory also holds the rank's own position (a
small array no other rank has). After each step the rank writes its snapshot to its buddy's replica file
(whole or absent) before reporting the step; a restarted incarnation adopts that replica.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np

from mindft.config import load_config
from mindft.exitcodes import ExitCode
from mindft.processor import Processor
from mindft.protocol import FaultKind
from mindft.snapshot import SnapshotStore

SIZE = 64
DATA_PARALLEL = os.environ.get("LAUNCH_DATA_PARALLEL") == "1"
GIVE_UP_CODE = int(ExitCode.DUMPED)  # the exit code of LAUNCH_GIVE_UP (dump_failed_rank.py changes it)


def initial(rank: int) -> np.ndarray:
    rank = 0 if DATA_PARALLEL else rank
    return np.linspace(-1.0, 1.0, SIZE) * (rank + 1)


def update(weights: np.ndarray, step: int, rank: int) -> np.ndarray:
    rank = 0 if DATA_PARALLEL else rank
    return np.tanh(weights * 1.0001 + np.sin(step * 0.37 + rank)) * 0.999


def reference(rank: int, steps: int) -> np.ndarray:
    """The fault-free result."""
    weights = initial(rank)
    for step in range(1, steps + 1):
        weights = update(weights, step, rank)
    return weights


class Rank:
    def __init__(self) -> None:
        self.config = load_config()
        self.rank, self.world = self.config.rank, self.config.world_size
        self.dir = Path(os.environ["LAUNCH_DIR"])
        self.steps = int(os.environ.get("LAUNCH_STEPS", "30"))
        self.step_time = float(os.environ.get("LAUNCH_STEP_TIME", "0.02"))
        crash = os.environ.get("LAUNCH_CRASH", "")
        self.crash_step = int(crash.split(":")[1]) if crash and int(crash.split(":")[0]) == self.rank else None
        always = os.environ.get("LAUNCH_CRASH_ALWAYS", "")
        self.crash_always = bool(always) and int(always) == self.rank
        give_up = os.environ.get("LAUNCH_GIVE_UP", "")
        self.give_up_step = (int(give_up.split(":")[1])
                             if give_up and int(give_up.split(":")[0]) == self.rank else None)
        self.step = 0
        self.armed: FaultKind | None = None
        self.weights = initial(self.rank)
        self.snapshots: dict[int, np.ndarray] = {0: self.weights.copy()}
        # The node agent's memory (mindft-launch's MINDFT_STATE_DIR), as a real rank keeps it.
        self.store = SnapshotStore(home=self.config.state_dir, resume=self.config.restart_count > 0) \
            if self.config.state_dir is not None else None
        if self.store is not None and self.store.steps:
            self.snapshots = {step: np.array(self.store.restore(step).arrays["weights"]) for step in self.store.steps}
        elif self.config.restart_count and os.environ.get("LAUNCH_NO_FILE_REPLICA") != "1":
            # The buddy's copy of this rank's last pushed snapshot.
            replica = self.dir / f"replica-of-{self.rank}.npz"
            with np.load(replica) as data:
                self.snapshots = {int(data["step"]): data["weights"].copy()}
        # Its node agent's keeper when the agents replicate (as a real rank announces it), else the file.
        self.processor = Processor(self.config, os.environ.get("MINDFT_REPLICA_ENDPOINT")
                                   or f"file://{self.dir}/replica-of-{self.rank}.npz")
        print(f"rank {self.rank} incarnation {self.config.restart_count} pid {os.getpid()} "
              f"holds {self.held}", flush=True)

    @property
    def held(self) -> list[int]:
        return sorted(self.snapshots)

    def capture(self, step: int) -> None:
        self.snapshots[step] = self.weights.copy()
        if self.store is not None:
            self.store.capture(step, {"weights": self.weights, "position": np.array([self.rank, step])})
            self.store.wait()
        for old in sorted(self.snapshots)[:-2]:
            del self.snapshots[old]
        target = self.dir / f"replica-of-{self.rank}.npz"
        temporary = self.dir / f".replica-of-{self.rank}.{os.getpid()}.npz"
        np.savez(temporary, step=step, weights=self.weights)
        os.replace(temporary, target)

    # ---- RankHooks ----

    def settle(self) -> list[int]:
        return self.held

    def restore(self, step: int) -> list[int]:
        print(f"rank {self.rank} ROLLBACK step {step}", flush=True)
        self.step, self.weights = step, self.snapshots[step].copy()
        self.snapshots = {s: w for s, w in self.snapshots.items() if s <= step}
        return self.held

    def resume(self, step: int) -> None:
        print(f"rank {self.rank} RESUME step {step}", flush=True)

    def arm(self, fault: FaultKind, detail: str) -> None:
        self.armed = fault

    def leave_device(self, reason: str) -> NoReturn:
        print(f"rank {self.rank} leaves its device: {reason}", flush=True)
        self.processor.close()
        sys.exit(ExitCode.LEFT_DEVICE)  # its buddy's copy (the replica file) outlives it

    def dump_and_exit(self, step: int, reason: str) -> NoReturn:
        step = step if step in self.snapshots else self.held[-1]
        dump = self.config.dump_dir
        dump.mkdir(parents=True, exist_ok=True)
        np.save(dump / f"rank{self.rank}-step{step}.npy", self.snapshots[step])
        print(f"rank {self.rank} dumped step {step}: {reason}", flush=True)
        self.processor.close()
        sys.exit(ExitCode.DUMPED)

    # ---- training ----

    def train_step(self, step: int) -> None:
        time.sleep(self.step_time)
        if step == self.give_up_step:
            print(f"rank {self.rank} gives up at step {step}", flush=True)
            os._exit(GIVE_UP_CODE)
        if self.crash_always and step == 2:
            os._exit(7)
        if step == self.crash_step:
            marker = self.dir / f"crashed-{self.rank}"
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        if self.armed is not None:
            fault, self.armed = self.armed, None
            raise RuntimeError(f"injected {fault.value}")
        self.weights = update(self.weights, step, self.rank)

    def run(self) -> None:
        processor = self.processor
        processor.register(self.held)
        if self.config.restart_count:
            processor.follow(self)
        while True:
            while self.step < self.steps:
                step = self.step + 1
                try:
                    self.train_step(step)
                except RuntimeError as error:
                    processor.report_fault(FaultKind.UCE, str(error), step)
                    processor.follow(self)
                    continue
                self.step = step
                processor.end_step(step, self, self.capture)  # a rollback moves self.step back
            if processor.finish(self.step, self) is None:
                break
        np.save(self.dir / f"final-{self.rank}.npy", self.weights)
        print(f"rank {self.rank} done at step {self.step}", flush=True)
        processor.close()


if __name__ == "__main__":
    if os.environ.get("LAUNCH_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Rank().run()
