"""A fake training rank for the coordination tests: the real Processor and its follow loop, no MindSpore.

Configured from the environment (load_config plus COORD_* variables):
  COORD_DIR        directory for replica files and event logs
  COORD_STEPS      steps to train (default 20)
  COORD_STEP_TIME  seconds per step (default 0.02)
  COORD_FAULT_AT   "STEP:KIND": report a fault of KIND inside STEP (once per job)
  COORD_ROLLBACK_FAULT  "1": report a fault instead of restoring on the first ROLLBACK
  COORD_COST       "STEP_S:SNAPSHOT_S": report these costs after step 2 (the job then picks the cadence)
  COORD_IGNORE     "pause", "rollback" or "resume": stall COORD_STALL seconds (default 4) in that
                   phase instead of answering, so the phase times out

The "model" is the running sum of step numbers, so the final state is n(n+1)/2 iff every
rollback restored the right step. After each snapshot the rank writes (step, state) to its
"replica" file, which a restarted incarnation adopts, like a replica fetched from its buddy.
Every event goes to COORD_DIR/events-<rank>.jsonl.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from mindft.config import load_config
from mindft.exitcodes import ExitCode
from mindft.processor import Processor
from mindft.protocol import FaultKind


class Rank:
    """The rank's state and its RankHooks."""

    def __init__(self) -> None:
        self.config = load_config()
        self.dir = Path(os.environ["COORD_DIR"])
        self.steps = int(os.environ.get("COORD_STEPS", "20"))
        self.step_time = float(os.environ.get("COORD_STEP_TIME", "0.02"))
        fault = os.environ.get("COORD_FAULT_AT", "")
        self.fault_at = (int(fault.split(":")[0]), FaultKind(fault.split(":")[1])) if fault else None
        self.rollback_fault = os.environ.get("COORD_ROLLBACK_FAULT") == "1"
        self.ignore = os.environ.get("COORD_IGNORE", "")
        self.stall = float(os.environ.get("COORD_STALL", "4"))
        cost = os.environ.get("COORD_COST", "")
        self.cost = tuple(float(v) for v in cost.split(":")) if cost else None
        self.rank = self.config.rank
        self.replica = self.dir / f"replica-{self.rank}.json"
        self.snapshots: dict[int, int] = {0: 0}
        self.step = 0
        self.state = 0
        self.armed: FaultKind | None = None
        if self.config.restart_count and self.replica.exists():
            held = json.loads(self.replica.read_text())
            self.snapshots = {held["step"]: held["state"]}
        self.processor = Processor(self.config, f"fake://{self.rank}/{self.config.restart_count}")

    def event(self, name: str, **fields: object) -> None:
        record = {"event": name, "rank": self.rank, "incarnation": self.config.restart_count,
                  "pid": os.getpid(), "step": self.step, "time": time.time(), **fields}
        with open(self.dir / f"events-{self.rank}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")

    @property
    def held(self) -> list[int]:
        return sorted(self.snapshots)

    def capture(self, step: int) -> None:
        self.event("capture", captured=step)
        self.snapshots[step] = self.state
        for old in sorted(self.snapshots)[:-2]:
            del self.snapshots[old]
        tmp = self.replica.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "state": self.state}))
        tmp.replace(self.replica)  # the buddy's copy: whole or absent

    def once(self, name: str) -> bool:
        marker = self.dir / f"once-{self.rank}-{name}"
        if marker.exists():
            return False
        marker.write_text("")
        return True

    # ---- RankHooks ----

    def settle(self) -> list[int]:
        self.event("action", action="pause", round=self.processor.follower.round)
        self._stall("pause")
        return self.held

    def restore(self, step: int) -> list[int]:
        self.event("action", action="rollback", action_step=step, round=self.processor.follower.round)
        self._stall("rollback")
        if self.rollback_fault and self.once("rollback-fault"):
            self.processor.report_fault(FaultKind.UNKNOWN, "fault while restoring", self.step)
            return self.held
        self.step, self.state = step, self.snapshots[step]
        self.snapshots = {s: v for s, v in self.snapshots.items() if s <= step}
        self.event("restored", endpoints={str(k): v for k, v in self.processor.endpoints.items()})
        return self.held

    def resume(self, step: int) -> None:
        self.event("action", action="resume", action_step=step, round=self.processor.follower.round)
        self._stall("resume")

    def arm(self, fault: FaultKind, detail: str) -> None:
        self.event("action", action="inject_fault", round=self.processor.follower.round)
        self.armed = fault

    def leave_device(self, reason: str) -> NoReturn:
        self.event("left_device", reason=reason)
        self.processor.close()
        sys.exit(ExitCode.LEFT_DEVICE)  # its buddy's copy (the replica file) outlives it

    def dump_and_exit(self, step: int, reason: str) -> NoReturn:
        self.event("dump", reason=reason, dump_step=step)
        self.processor.close()
        sys.exit(ExitCode.DUMPED)

    def _stall(self, phase: str) -> None:
        if self.ignore == phase:
            self.event("stall", phase=phase)
            time.sleep(self.stall)

    # ---- training ----

    def follow(self, action=None) -> None:
        self.processor.follow(self, action)

    def run(self) -> None:
        ack = self.processor.register(self.held)
        self.event("registered", endpoints=len(ack.endpoints), held=self.held, state=ack.state)
        if self.config.restart_count:
            self.follow()
        while True:
            while self.step < self.steps:
                step = self.step + 1
                time.sleep(self.step_time)
                planned = self.fault_at and self.fault_at[0] == step and self.once("fault")
                if self.armed is not None or planned:
                    kind = self.armed or self.fault_at[1]
                    self.armed = None
                    self.event("fault", kind=kind.value)
                    self.processor.report_fault(kind, "test fault", step)
                    self.follow()
                    continue
                self.state += step
                self.step = step
                self.processor.end_step(step, self, self.capture)  # a rollback moves self.step back
                if self.cost and step == 2 and self.processor.reports_costs:
                    self.processor.report_cost(*self.cost)
            if self.processor.finish(self.step, self) is None:
                break
        self.event("done", state=self.state)
        self.processor.close()


if __name__ == "__main__":
    Rank().run()
