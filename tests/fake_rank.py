"""The one scriptable fake training rank of the process tests: mindft's rank engine, no MindSpore.

Its behaviour comes from the environment. The variables share one vocabulary under the prefix
of the test family that sets them (``COORD_``, ``LAUNCH_``, ``REPLICA_``, ``PLAIN_``); the
family's directory variable (``<PREFIX>DIR``) picks the mode:

* no directory variable: **plain**, a rank that knows nothing of mindft (launcher tests that need
  no controller): ``EXIT`` "RANK:CODE" (that rank exits with CODE after ``SLEEP`` seconds),
  ``PID_DIR`` (write pid-<rank> there at start);
* ``REPLICA_DIR``: **engine**, :class:`mindft.rank.engine.RankEngine` as the MindSpore session uses it:
  a SnapshotStore, the buddy rank's replica Keeper and this rank's RankReplication;
* ``COORD_DIR`` or ``LAUNCH_DIR``: **loop**, :class:`mindft.rank.loop.RankLoop` with hooks of its own:
  snapshots in a dict (and in the node agent's memory when mindft-launch gives one), a "replica"
  file ``replica-<rank>.json`` per capture that a restarted incarnation adopts.

Options (after the prefix):
  STEPS, STEP_TIME   steps to train (default 20), seconds per step (default 0.02)
  FLOATS             size of the weight vector (default 64; 262144, 2 MiB, in engine mode)
  FAULT_AT           "STEP:KIND": report a fault of KIND inside STEP (once per job)
  ROLLBACK_FAULT     "1": report a fault instead of restoring on the first ROLLBACK
  COST               "STEP_S:SNAPSHOT_S": report these costs after step 2 (the job then picks the cadence)
  IGNORE, STALL      "pause", "rollback" or "resume": stall STALL seconds (default 4) there, so the phase times out
  CRASH              "RANK:STEP": that rank SIGKILLs itself inside STEP, once per job
  CRASH_ALWAYS       "RANK": that rank exits with code 9 at step 2 in every incarnation
  GIVE_UP            "RANK:STEP[:CODE]": that rank exits CODE (default 3, as after its own dying gasp) inside STEP
  IGNORE_TERM        "1": ignore SIGTERM (the launcher must escalate to SIGKILL)
  SEGFAULT_AT_EXIT   "RANK": that rank kills itself with SIGSEGV once it finished (as MindSpore's teardown may)
  LEAVE_SECONDS      seconds a rank takes to leave its device once told (default 0; a real one tears down)
  NO_FILE_REPLICA    "1": a restarted rank finds its state only in its node agent's memory
  DATA_PARALLEL      "1": every rank's weights are the same, as data-parallel ranks' are
  HOLD               "STEP": before capturing STEP (first incarnation only), wait until the file
                     ``go-<rank>`` exists in the directory (the test kills the buddy meanwhile)

The model is a float64 vector updated by a non-linear, step-dependent rule (its final bytes equal
:func:`reference` only if every rollback restored exactly the right step) and the running sum of
step numbers (n(n+1)/2 at the end iff so). Every event goes to ``<DIR>/events-<rank>.jsonl``; the
launcher tests read the lines printed on stdout and ``final-<rank>.npy``.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Mapping, NoReturn, Optional

import numpy as np

PREFIXES = ("COORD_", "LAUNCH_", "REPLICA_")
DEFAULT_FLOATS, ENGINE_FLOATS = 64, 256 * 1024


def initial(rank: int, size: int = DEFAULT_FLOATS) -> np.ndarray:
    """The weights a rank starts from."""
    return np.linspace(-1.0, 1.0, size) * (rank + 1)


def update(weights: np.ndarray, step: int, rank: int) -> np.ndarray:
    """The weights after ``step``."""
    return np.tanh(weights * 1.0001 + np.sin(step * 0.37 + rank)) * 0.999


def reference(rank: int, steps: int, size: int = DEFAULT_FLOATS) -> np.ndarray:
    """The fault-free weights after ``steps`` (``rank`` 0 for data-parallel ranks)."""
    weights = initial(rank, size)
    for step in range(1, steps + 1):
        weights = update(weights, step, rank)
    return weights


class Options:
    """The rank's behaviour, from the environment variables under ``prefix``."""

    def __init__(self, prefix: str, rank: int, replicate: bool) -> None:
        def get(name: str, default: str = "") -> str:
            return os.environ.get(prefix + name, default)

        def for_me(name: str) -> Optional[list[str]]:  # "RANK:..." options that name this rank
            parts = get(name).split(":")
            return parts[1:] if parts[0] and int(parts[0]) == rank else None

        self.dir = Path(get("DIR"))
        self.steps = int(get("STEPS", "20"))
        self.step_time = float(get("STEP_TIME", "0.02"))
        self.floats = int(get("FLOATS", str(ENGINE_FLOATS if replicate else DEFAULT_FLOATS)))
        fault = get("FAULT_AT")
        self.fault_at = (int(fault.split(":")[0]), fault.split(":")[1]) if fault else None
        self.rollback_fault = get("ROLLBACK_FAULT") == "1"
        self.cost = tuple(float(v) for v in get("COST").split(":")) if get("COST") else None
        self.ignore, self.stall = get("IGNORE"), float(get("STALL", "4"))
        crash = for_me("CRASH")
        self.crash_step = int(crash[0]) if crash else None
        self.crash_always = get("CRASH_ALWAYS") != "" and int(get("CRASH_ALWAYS")) == rank
        give_up = for_me("GIVE_UP")
        self.give_up = (int(give_up[0]), int(give_up[1]) if len(give_up) > 1 else 3) if give_up else None
        self.no_file_replica = get("NO_FILE_REPLICA") == "1"
        self.model_rank = 0 if get("DATA_PARALLEL") == "1" else rank
        self.hold = int(get("HOLD")) if get("HOLD") else None
        self.leave_seconds = float(get("LEAVE_SECONDS", "0"))
        self.segfault_at_exit = get("SEGFAULT_AT_EXIT") != "" and int(get("SEGFAULT_AT_EXIT")) == rank


class Fake:
    """What every mode shares: the model, the options, the event log and the step's own faults."""

    def __init__(self, config: Any, options: Options) -> None:
        self.config, self.options = config, options
        self.rank = config.rank
        self.dir = options.dir
        self.weights = initial(options.model_rank, options.floats)
        self.total = np.zeros(1, dtype=np.int64)  # the running sum of step numbers
        self.armed: Optional[str] = None

    def event(self, name: str, **fields: object) -> None:
        record = {"event": name, "rank": self.rank, "incarnation": self.config.restart_count,
                  "pid": os.getpid(), "step": self.position, "time": time.time(), **fields}
        with open(self.dir / f"events-{self.rank}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def say(self, text: str) -> None:
        print(f"rank {self.rank} {text}", flush=True)

    def once(self, name: str) -> bool:
        marker = self.dir / f"once-{self.rank}-{name}"
        if marker.exists():
            return False
        marker.write_text(str(os.getpid()))
        return True

    def train_step(self, step: int) -> Optional[tuple[str, str]]:
        """Run ``step``: (kind, detail) of a fault inside it, or None when it went through."""
        options = self.options
        time.sleep(options.step_time)
        if options.give_up is not None and step == options.give_up[0]:
            self.say(f"gives up at step {step}")
            os._exit(options.give_up[1])
        if options.crash_always and step == 2:
            os._exit(9)
        if step == options.crash_step and self.once("crash"):
            os.kill(os.getpid(), signal.SIGKILL)
        planned = options.fault_at is not None and options.fault_at[0] == step and self.once("fault")
        if self.armed is not None or planned:
            kind = self.armed or options.fault_at[1]
            self.armed = None
            self.event("fault", kind=kind)
            return kind, f"injected {kind}"
        self.weights[:] = update(self.weights, step, options.model_rank)
        self.total += step
        return None

    def stall_in(self, phase: str) -> None:
        if self.options.ignore == phase:
            self.event("stall", phase=phase)
            time.sleep(self.options.stall)

    def done(self) -> None:
        uniform = self.weights.tobytes() == reference(self.options.model_rank, self.position,
                                                       self.options.floats).tobytes()
        self.event("done", state=int(self.total[0]), uniform=uniform)
        np.save(self.dir / f"final-{self.rank}.npy", self.weights)
        self.say(f"done at step {self.position}")
        if self.options.segfault_at_exit:
            os.kill(os.getpid(), signal.SIGSEGV)

    @property
    def position(self) -> int:
        raise NotImplementedError


class LoopRank(Fake):
    """Loop mode: :class:`mindft.rank.loop.RankLoop` with this rank's own RankHooks."""

    def __init__(self, config: Any, options: Options) -> None:
        from mindft.rank.processor import Processor
        from mindft.rank.loop import RankLoop
        from mindft.snapshot.store import SnapshotStore

        super().__init__(config, options)
        self.step = 0
        self.snapshots: dict[int, tuple[np.ndarray, int]] = {0: (self.weights.copy(), 0)}
        self.replica = self.dir / f"replica-{self.rank}.json"
        # The node agent's memory (mindft-launch's MINDFT_STATE_DIR), as a real rank keeps it.
        self.store = SnapshotStore(home=config.state_dir, resume=config.restart_count > 0) \
            if config.state_dir is not None else None
        if self.store is not None and self.store.steps:
            self.snapshots = {}
            for step in self.store.steps:
                arrays = self.store.restore(step).arrays
                self.snapshots[step] = (np.array(arrays["weights"]), int(arrays["position"][2]))
            self.event("adopted", adopted=max(self.snapshots), source="node agent")
        elif config.restart_count and not options.no_file_replica and self.replica.exists():
            held = json.loads(self.replica.read_text())  # the buddy's copy of this rank's last snapshot
            self.snapshots = {held["step"]: (np.array(held["weights"]), held["state"])}
            self.event("adopted", adopted=held["step"], source="file")
        self.processor = Processor(config, config.replica_endpoint or f"fake://{self.rank}/{config.restart_count}")
        self.loop = RankLoop(self.processor, self)
        self.say(f"incarnation {config.restart_count} pid {os.getpid()} holds {self.held}")

    @property
    def position(self) -> int:
        return self.step

    @property
    def held(self) -> list[int]:
        return sorted(self.snapshots)

    def capture(self, step: int) -> None:
        self.event("capture", captured=step)
        self.snapshots[step] = (self.weights.copy(), int(self.total[0]))
        if self.store is not None:
            # The position is this rank's own (no other rank holds the same bytes): rank, step, sum.
            self.store.capture(step, {"weights": self.weights,
                                      "position": np.array([self.rank, step, int(self.total[0])])})
            self.store.wait()
        for old in sorted(self.snapshots)[:-2]:
            del self.snapshots[old]
        temporary = self.replica.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"step": step, "state": int(self.total[0]),
                                         "weights": self.weights.tolist()}))
        temporary.replace(self.replica)  # the buddy's copy: whole or absent

    # ---- RankHooks ----

    def settle(self) -> list[int]:
        self.event("action", action="pause", round=self.processor.follower.round)
        self.stall_in("pause")
        return self.held

    def restore(self, step: int) -> list[int]:
        self.event("action", action="rollback", action_step=step, round=self.processor.follower.round)
        self.stall_in("rollback")
        if self.options.rollback_fault and self.once("rollback-fault"):
            self.processor.report_fault("unknown", "fault while restoring", self.step)
            return self.held
        weights, total = self.snapshots[step]
        if self.store is not None:
            # Through the store, as a real rank restores: its next capture must then spare this
            # step's slot, which a replica of another rank may point into.
            self.store.restore(step)
        self.step, self.weights[:], self.total[0] = step, weights, total
        self.snapshots = {s: v for s, v in self.snapshots.items() if s <= step}
        self.say(f"ROLLBACK step {step}")
        self.event("restored", endpoints={str(k): v for k, v in self.processor.endpoints.items()})
        return self.held

    def resume(self, step: int) -> None:
        self.event("action", action="resume", action_step=step, round=self.processor.follower.round)
        self.stall_in("resume")
        self.say(f"RESUME step {step}")
        self.event("resumed")

    def arm(self, fault: Any, detail: str) -> None:
        self.event("action", action="inject_fault", round=self.processor.follower.round)
        self.armed = fault.value

    def leave_device(self, reason: str) -> NoReturn:
        self.event("left_device", reason=reason)
        self.say(f"leaves its device: {reason}")
        time.sleep(self.options.leave_seconds)
        self.processor.close()
        sys.exit(6)  # ExitCode.LEFT_DEVICE: its buddy's copy (the replica file) outlives it

    def dump_and_exit(self, step: int, reason: str) -> NoReturn:
        step = step if step in self.snapshots else self.held[-1]
        self.event("dump", reason=reason, dump_step=step)
        dump = self.config.dump_dir
        dump.mkdir(parents=True, exist_ok=True)
        np.save(dump / f"rank{self.rank}-step{step}.npy", self.snapshots[step][0])
        self.say(f"dumped step {step}: {reason}")
        self.processor.close()
        sys.exit(3)  # ExitCode.DUMPED

    # ---- training ----

    def run(self) -> None:
        from mindft.protocol import FaultKind

        loop, processor = self.loop, self.processor
        ack = loop.register(self.held)
        self.event("registered", endpoints=len(ack.endpoints), held=self.held, state=ack.state)
        loop.rejoin(ack, restarted=self.config.restart_count > 0, adopted=True, held=self.held)
        while True:
            while self.step < self.options.steps:
                step = self.step + 1
                fault = self.train_step(step)
                if fault is not None:
                    loop.fault(FaultKind(fault[0]), fault[1], step)
                    continue
                self.step = step
                loop.end_step(step, self.capture)  # a rollback moves self.step back
                if self.options.cost and step == 2 and processor.reports_costs:
                    processor.report_cost(*self.options.cost)
            if loop.finish(self.step) is None:
                break
        self.done()
        processor.close()


def engine_rank(config: Any, options: Options) -> Any:
    """Engine mode: :class:`mindft.rank.engine.RankEngine` over this rank's model, with events."""
    from mindft.rank.engine import RankEngine
    from mindft.snapshot.store import SnapshotStore

    class EngineRank(Fake, RankEngine):
        def __init__(self) -> None:
            Fake.__init__(self, config, options)
            RankEngine.__init__(self, self, config)

        @property
        def position(self) -> int:
            return self.step

        # ---- StateHooks ----

        def arrays(self) -> Mapping[str, np.ndarray]:
            return {"w": self.weights, "total": self.total}

        def load(self, store: SnapshotStore, step: int) -> Mapping[str, Any]:
            snapshot = store.restore(step, into=self.arrays())
            return snapshot.meta

        # ---- the engine's hooks, with events ----

        def _capture(self, step: int) -> None:
            if step == options.hold and not config.restart_count:
                self.event("holding", before_capture=step)
                while not (self.dir / f"go-{self.rank}").exists():
                    time.sleep(0.01)
            self.event("capture", captured=step)
            RankEngine._capture(self, step)
            self.store.wait()
            self.event("captured", captured=step)

        def _adopt_replica(self) -> bool:
            adopted = RankEngine._adopt_replica(self)
            if adopted:
                self.event("adopted", adopted=max(self.store.steps), source="buddy")
            return adopted

        def settle(self) -> tuple[int, ...]:
            held = RankEngine.settle(self)
            sender = self._replication.sender
            # What the pause found: is a push to the buddy still unconfirmed, has its timeout expired?
            self.event("settled", held=list(held), in_flight=sender.in_flight, push_timeouts=sender.timeouts,
                       unconfirmed=list(self._replication.unconfirmed))
            return held

        def restore(self, step: int) -> tuple[int, ...]:
            held = RankEngine.restore(self, step)
            self.event("restored")
            return held

        def resume(self, step: int) -> None:
            RankEngine.resume(self, step)
            self.event("resumed")

        def dump_and_exit(self, step: int, reason: str) -> NoReturn:
            self.event("dump", reason=reason)
            RankEngine.dump_and_exit(self, step, reason)

        def run(self) -> None:
            self.start()
            while True:
                while self.step < options.steps:
                    try:
                        self.begin_step()
                        fault = self.train_step(self.step + 1)
                        if fault is not None:
                            from mindft.rank.faults import DeviceFault
                            from mindft.protocol import FaultKind
                            raise DeviceFault(FaultKind(fault[0]), fault[1])
                    except Exception as error:  # noqa: BLE001 - reported as the session reports it
                        self.fault(error)
                        continue
                    self.end_step()  # a rollback moves self.step back
                if self.finish() is None:
                    break
            self.done()
            self.close()

    return EngineRank()


def plain(prefix: str = "PLAIN_") -> None:
    """A rank that knows nothing of mindft."""
    rank = int(os.environ.get("RANK_ID", "0"))
    pid_dir = os.environ.get(prefix + "PID_DIR")
    if pid_dir:
        Path(pid_dir, f"pid-{rank}").write_text(str(os.getpid()))
    print(f"plain rank {rank} of {os.environ.get('RANK_SIZE')} running", flush=True)
    time.sleep(float(os.environ.get(prefix + "SLEEP", "0")))
    failing = os.environ.get(prefix + "EXIT", "")
    if failing and int(failing.split(":")[0]) == rank:
        print(f"plain rank {rank} exits with code {failing.split(':')[1]}", flush=True)
        sys.exit(int(failing.split(":")[1]))
    print(f"plain rank {rank} done", flush=True)


def main() -> None:
    prefix = next((p for p in PREFIXES if os.environ.get(p + "DIR")), None)
    if prefix is None:
        plain()
        return
    if os.environ.get(prefix + "IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from mindft.config import load_config

    config = load_config()
    replicate = prefix == "REPLICA_"
    options = Options(prefix, config.rank, replicate)
    rank = engine_rank(config, options) if replicate else LoopRank(config, options)
    rank.run()


if __name__ == "__main__":
    main()
