"""A fake training rank for the coordination tests: real Processor, no MindSpore.

Configured from the environment (load_config plus COORD_* variables):
  COORD_DIR        directory for replica files and event logs
  COORD_STEPS      steps to train (default 20)
  COORD_STEP_TIME  seconds per step (default 0.02)
  COORD_FAULT_AT   "STEP:KIND": report a fault of KIND inside STEP (once per job)
  COORD_ROLLBACK_FAULT  "1": report a fault instead of acknowledging the first ROLLBACK
  COORD_IGNORE     "pause", "rollback" or "resume": never acknowledge that action (to make
                   its phase time out); the rank keeps waiting for the next action

The "model" is the running sum of step numbers, so the final state is n(n+1)/2 iff every
rollback restored the right step. After each step the rank writes (step, state) to its
"replica" file, which a restarted incarnation adopts, like a replica fetched from its buddy.
Every event goes to COORD_DIR/events-<rank>.jsonl.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from mindft.config import load_config
from mindft.processor import Processor
from mindft.protocol import ActionKind, FaultKind

EXIT_DUMPED = 3
ACTION_WAIT = 60.0


class Rank:
    def __init__(self) -> None:
        self.config = load_config()
        self.dir = Path(os.environ["COORD_DIR"])
        self.steps = int(os.environ.get("COORD_STEPS", "20"))
        self.step_time = float(os.environ.get("COORD_STEP_TIME", "0.02"))
        fault = os.environ.get("COORD_FAULT_AT", "")
        self.fault_at = (int(fault.split(":")[0]), FaultKind(fault.split(":")[1])) if fault else None
        self.rollback_fault = os.environ.get("COORD_ROLLBACK_FAULT") == "1"
        self.ignore = os.environ.get("COORD_IGNORE", "")
        self.rank = self.config.rank
        self.replica = self.dir / f"replica-{self.rank}.json"
        self.snapshots: dict[int, int] = {}
        self.step = 0
        self.state = 0
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

    def handle(self, action) -> None:
        """Follow the controller until it says RESUME."""
        while action is not None:
            self.event("action", action=action.kind.value, action_step=action.step, round=action.round)
            if action.kind.value == self.ignore:
                pass
            elif action.kind is ActionKind.PAUSE:
                self.processor.acknowledge(action, self.step, self.held)
            elif action.kind is ActionKind.ROLLBACK:
                if self.rollback_fault and self.once("rollback-fault"):
                    self.processor.report_fault(FaultKind.UNKNOWN, "fault while restoring", self.step)
                else:
                    self.step, self.state = action.step, self.snapshots[action.step]
                    self.snapshots = {s: v for s, v in self.snapshots.items() if s <= action.step}
                    self.event("restored", endpoints={str(k): v for k, v in self.processor.endpoints.items()})
                    self.processor.acknowledge(action, self.step, self.held)
            elif action.kind is ActionKind.RESUME:
                self.processor.acknowledge(action, self.step, self.held)
                return
            elif action.kind is ActionKind.DUMP_AND_EXIT:
                self.event("dump", reason=action.reason)
                self.processor.close()
                sys.exit(EXIT_DUMPED)
            elif action.kind is ActionKind.INJECT_FAULT:
                self.processor.report_fault(action.fault or FaultKind.UNKNOWN, "injected", self.step + 1)
            action = self.processor.wait_action(ACTION_WAIT)

    def run(self) -> None:
        ack = self.processor.register(self.held)
        self.event("registered", endpoints=len(ack.endpoints), held=self.held, state=ack.state)
        if self.config.restart_count:
            self.handle(self.processor.wait_action(ACTION_WAIT))
        while True:
            self.handle(self.processor.poll_action())
            if self.step >= self.steps:
                break
            step = self.step + 1
            self.processor.step_begin(step)
            time.sleep(self.step_time)
            if self.fault_at and self.fault_at[0] == step and self.once("fault"):
                self.event("fault", kind=self.fault_at[1].value)
                self.processor.report_fault(self.fault_at[1], "test fault", step)
                self.handle(self.processor.wait_action(ACTION_WAIT))
                continue
            self.state += step
            self.capture(step)
            action = self.processor.step_end(step)
            self.step = step
            self.handle(action)
        self.processor.done(self.step)
        self.event("done", state=self.state)
        self.processor.close()


if __name__ == "__main__":
    Rank().run()
