"""The per-rank engine shared by the ``Model.train`` callback and the custom-loop guard.

A :class:`Session` owns one rank's :class:`~mindft.snapshot.SnapshotStore`, its
:class:`~mindft.processor.Processor` and, when no node agent replicates it, the keeper of its
buddy's replica and the background replication of its own (:mod:`mindft.replica`). The
two front ends only tell it where step boundaries are; it captures, votes, and obeys the
controller.

Steps are counted from 1 (``step`` = number of optimizer updates done); the snapshot of
step 0 is the state training starts from, so a fault in the very first step can be
rolled back too.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, Mapping, NoReturn, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindft.channel import ControllerUnreachable, request
from mindft.config import ConfigError, MindftConfig, load_config
from mindft.exitcodes import ExitCode
from mindft.faults import DeviceFault, classify, describe
from mindft.flow.cadence import smoothed
from mindft.keys import job_keys
from mindft.processor import Processor, ProcessorError
from mindft.protocol import FaultKind, StatusRequest
from mindft.replica import Keeper, RankReplication, fetch_replica, replica_spill, store_slots
from mindft.snapshot import SnapshotError, SnapshotStore
from mindft.threadcpu import ThreadCpu

log = logging.getLogger(__name__)

EXIT_DUMPED = int(ExitCode.DUMPED)
# A step that faults this many times in a row is not a transient device fault: stop replaying it.
MAX_FAULTS_PER_STEP = 3
# Controller states in which a restarted rank that holds nothing may simply start training.
_RUNNING_STATES = ("STARTING", "NORMAL")
# The measured costs the job chooses the cadence from: smoothed with this weight per sample,
# reported when one moves by more than COST_CHANGE (relative), or when a snapshot's share of a
# step (capture / step, what the cadence follows) rises by more than COST_RISE: the cadence may
# then be over the budget. At most every COST_REPORT_INTERVAL s.
COST_SMOOTHING = 0.3
COST_CHANGE = 0.2
COST_RISE = 0.05
COST_REPORT_INTERVAL = 1.0


class CostMeter:
    """What a training step and a snapshot cost this rank, smoothed, and when to report them."""

    def __init__(self) -> None:
        self.step_time: Optional[float] = None
        self.capture_time: Optional[float] = None
        self._sent: Optional[Tuple[float, float]] = None
        self._sent_at = -1e9

    def step(self, seconds: float) -> None:
        self.step_time = smoothed(self.step_time, max(seconds, 0.0), COST_SMOOTHING)

    def capture(self, seconds: float) -> None:
        self.capture_time = smoothed(self.capture_time, max(seconds, 0.0), COST_SMOOTHING)

    def due(self, now: float) -> Optional[Tuple[float, float]]:
        """The figures to report now, if any (then they count as sent)."""
        if self.step_time is None or self.capture_time is None:
            return None
        figures = (self.step_time, self.capture_time)
        if self._sent is not None:
            if now - self._sent_at < COST_REPORT_INTERVAL:
                return None
            moved = any(abs(new - old) > COST_CHANGE * old for new, old in zip(figures, self._sent))
            sent_step, sent_capture = self._sent
            share, sent_share = _share(*figures), _share(sent_step, sent_capture)
            if not moved and share <= sent_share * (1 + COST_RISE):
                return None
        self._sent, self._sent_at = figures, now
        return figures


def _share(step_time: float, capture_time: float) -> float:
    """A snapshot's cost in steps' time (what the budget's cadence is proportional to)."""
    return capture_time / step_time if step_time > 0 else float("inf")


class RewindRequired(RuntimeError):
    """Training must continue from an earlier step than the one the data pipeline is at.

    Raised out of ``Model.train`` by the callback; :func:`mindft.mindspore.train` catches it
    and re-enters ``Model.train`` at batch ``step + 1``.
    """

    def __init__(self, step: int) -> None:
        super().__init__(f"rolled back to step {step}: re-enter training at batch {step + 1} "
                         f"(use mindft.mindspore.train(...) instead of Model.train to do this for you)")
        self.step = step


class StepInterrupted(RuntimeError):
    """The controller acted before this step's collectives: the step is abandoned (nothing in
    it was applied yet) and the rank follows the action; the step is replayed after it."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} interrupted before its collectives by the controller")
        self.step = step


def collective_gate(cell: nn.Cell, optimizer: Optional[nn.Cell]) -> Optional[Tuple[nn.Cell, bool]]:
    """Where a step of ``cell`` is last before its gradients are all-reduced: (the Cell, True
    for a forward pre-hook / False for a forward hook), or None when there is no such Cell.

    A ``DistributedGradReducer`` inside ``cell`` (``Model.train``'s ``TrainOneStepCell`` in data
    parallel mode) is called after the forward and backward passes, just before the all-reduce:
    a pre-hook on it. Otherwise the network's own forward: a hook after it (a custom loop's
    reducer is not known to mindft; the backward pass is still to come). A cell that holds the
    optimizer with no reducer is a whole training step: no gate.
    """
    for _, sub in cell.cells_and_names():
        if isinstance(sub, nn.DistributedGradReducer):
            return sub, True
    if optimizer is not None and any(sub is optimizer for _, sub in cell.cells_and_names()):
        return None
    return cell, False


class TrainingState:
    """Every Parameter that defines where training is: the network's and the optimizer's.

    On CPU ``Parameter.asnumpy()`` returns a view of the parameter's memory, so capture
    reads and restore writes those views directly; elsewhere restore falls back to
    ``ops.assign``.
    """

    def __init__(self, cell: nn.Cell, optimizer: Optional[nn.Cell] = None) -> None:
        params: Dict[str, ms.Parameter] = {}
        for owner in (cell, optimizer):
            if owner is None:
                continue
            for param in owner.get_parameters():
                params.setdefault(param.name, param)
        if not params:
            raise ValueError(f"{type(cell).__name__} has no parameters to protect")
        self.cell = cell
        self.params = params
        probe = next(iter(params.values()))
        self.aliased = bool(np.shares_memory(probe.asnumpy(), probe.asnumpy()))
        if not self.aliased:
            log.warning("Parameter.asnumpy() copies on this device: restores use ops.assign")

    def arrays(self) -> Dict[str, np.ndarray]:
        """The current values (views on CPU: do not let the optimizer run while they are read)."""
        return {name: param.asnumpy() for name, param in self.params.items()}

    def load(self, store: SnapshotStore, step: int) -> Mapping[str, Any]:
        """Restore the snapshot of exactly ``step`` into the parameters; returns its meta."""
        if self.aliased:
            snapshot = store.restore(step, into=self.arrays())
        else:
            snapshot = store.restore(step)
            for name, array in snapshot.arrays.items():
                ops.assign(self.params[name], ms.Tensor(np.array(array)))
        if snapshot.step != step:
            raise SnapshotError(f"asked to restore step {step}, the newest verified snapshot is "
                                f"step {snapshot.step}")
        return snapshot.meta


def replica_buddy(config: MindftConfig) -> Optional[int]:
    """The rank that holds this rank's replica (MINDFT_REPLICA_BUDDY; default the next rank),
    None when there is none: alone, or on one node where the node agent's memory holds the
    state (a copy on the same node guards against nothing more, and costs every step)."""
    if config.world_size == 1 or config.replica_buddy == -1:
        return None
    return (config.rank + 1) % config.world_size if config.replica_buddy is None else config.replica_buddy


def uses_collectives() -> bool:
    """True once mindspore.communication.init() formed a communicator of several ranks: a
    restarted process cannot rejoin it (MCCL on CPU), so a lost process restarts every worker."""
    from mindspore.communication import get_group_size
    from mindspore.communication._comm_helper import GlobalComm

    return bool(GlobalComm.INITED) and get_group_size() > 1


def rng_meta() -> Dict[str, Any]:
    """MindSpore's global generator state, JSON-able (ops that draw from it replay exactly)."""
    return {"rng_state": [int(v) for v in ms.get_rng_state().asnumpy().tolist()]}


def set_rng(meta: Mapping[str, Any]) -> None:
    """Put back the generator state recorded by :func:`rng_meta`."""
    state = meta.get("rng_state")
    if state is not None:
        ms.set_rng_state(ms.Tensor(np.asarray(state, dtype=np.uint8)))


class Session:
    """One rank's part in the recovery flow (see the module docstring); the rank's RankHooks.

    ``state`` names the parameters to protect; ``optimizer`` is the Cell whose call must
    not start while a capture reads the parameters. With ``overlap`` (default: in PyNative
    mode) a forward pre-hook on it waits there, so the copy of step ``s`` overlaps the
    forward and backward passes of step ``s + 1``; otherwise each capture completes at
    the end of its step. If the hook turns out not to run (the optimizer is called
    inside ``ms.jit``), the session notices after one step and stops overlapping.

    ``snapshot_every=N`` captures (and replicates) only every N-th step: every rank of
    a job must use the same N; a fault then replays up to N steps (CheckFreq's trade).
    Without it (and without MINDFT_SNAPSHOT_EVERY) the job chooses N within the overhead
    budget from what this rank measures (:class:`CostMeter`) and reports.
    """

    def __init__(self, state: TrainingState, optimizer: Optional[nn.Cell],
                 config: Optional[MindftConfig] = None, overlap: Optional[bool] = None,
                 snapshot_every: Optional[int] = None) -> None:
        if snapshot_every is not None and snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.config = config if config is not None else load_config()
        self._snapshot_every = snapshot_every
        self.snapshot_every = snapshot_every or self.config.snapshot_every or 1  # the initial cadence
        self.costs = CostMeter()
        self._step_exit: Optional[float] = None  # when end_step last returned (training resumed)
        self._hook_wait = 0.0  # seconds the optimizer waited for a capture during this step
        self._overlapped_capture = 0.0  # the synchronous part of an overlapped capture still copying
        self.state = state
        self.enabled = self.config.tft.enabled
        self.step = 0
        self.meta: Dict[str, Any] = {}
        self.resumed_from: Optional[int] = None
        self.processor: Optional[Processor] = None
        self.store: Optional[SnapshotStore] = None
        self._keeper: Optional[Keeper] = None  # holds the replica of the rank whose buddy this one is
        self._replication: Optional[RankReplication] = None  # streams this rank's snapshots to its buddy
        self._replication_cpu = ThreadCpu()  # the keeper's and the replication's threads: the budget counts them
        self._buddy = replica_buddy(self.config)
        self._keys = None
        self._armed: Optional[DeviceFault] = None
        self._faults_at: Dict[int, int] = {}
        self._hook_seen = False
        if overlap is None:
            # Graph mode compiles Cell hooks into the graph (where they break it): PyNative only.
            overlap = ms.get_context("mode") == ms.PYNATIVE_MODE
        self._overlap = bool(overlap) and optimizer is not None
        self._optimizer = optimizer
        self._hook = None
        # Lockstep before the collectives (see _gate_collectives): the hook, whether it ran in
        # the current step, and the action that interrupted a step there.
        self._gate = None
        self._gate_seen = True
        self._interrupt = None
        self._rollback_started = 0.0
        self.last_recovery: Dict[str, float] = {}
        if not self.enabled:
            log.info("rank=%d mindft off (MS_ENABLE_TFT=%r enables nothing): training runs unprotected",
                     self.config.rank, os.environ.get("MS_ENABLE_TFT", ""))
            return
        if self._overlap:
            self._hook = optimizer.register_forward_pre_hook(self._before_update)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, meta: Optional[Mapping[str, Any]] = None) -> int:
        """Join the job; restore this rank if it is a restarted one. Returns the step to continue after."""
        if not self.enabled:
            return self.step
        config = self.config
        try:
            self._keys = job_keys(config)
        except ConfigError as error:
            log.critical("rank=%d cannot join the job: %s", config.rank, error)
            raise SystemExit(ExitCode.USAGE) from None
        restarted = config.restart_count > 0
        try:
            self.store = SnapshotStore(home=config.state_dir, resume=restarted)
        except SnapshotError as error:
            log.critical("rank=%d %s", config.rank, error)
            raise SystemExit(ExitCode.USAGE) from None
        if self._buddy is not None:
            self._keeper = Keeper(None, config.controller_ip, self._keys, local=store_slots(self.store),
                                  spill=replica_spill(config.dump_dir, f"rank{config.rank}"), cpu=self._replication_cpu)
        adopted = False
        if restarted and self.store.steps:
            adopted = True
            log.warning("rank=%d restarted (incarnation %d): steps %s are in the node agent's memory",
                        config.rank, config.restart_count, list(self.store.steps))
        elif restarted:
            adopted = self._adopt_replica()
        self.processor = Processor(config, self._keeper.endpoint if self._keeper else "", keys=self._keys,
                                   snapshot_every=self._snapshot_every)
        collectives = uses_collectives()
        self.processor.lockstep = collectives  # a fault at a boundary then rolls back in place
        try:
            ack = self.processor.register(held_steps=self.store.steps, collectives=collectives)
        except ProcessorError as error:
            log.critical("%s", error)
            self.close()
            raise SystemExit(ExitCode.FAILED) from None
        if self._buddy is not None:
            self._start_replication()
        if config.restart_count > 0 and (adopted or ack.state.upper() not in _RUNNING_STATES):
            log.warning("rank=%d restarted (incarnation %d) holding %s; waiting for ROLLBACK",
                        config.rank, config.restart_count, list(self.store.steps))
            self.processor.follow(self)
        else:
            self.meta = dict(meta or {})
            self._capture(self.step)
            self.store.wait()
        if collectives:
            self._gate_collectives()
        return self.step

    def close(self) -> None:
        """Leave the job: stop the processor and free the snapshots (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._replication is not None:
            self._replication.close()
            self._replication = None
        self._ungate()
        if self.processor is not None:
            self.processor.close()
            self.processor = None
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None

    def finish(self) -> Optional[int]:
        """Report Done at the current step and wait for every rank.

        Returns None when the job finished (then :meth:`close`), or the step training was
        rolled back to when a rank faulted before every rank was done (train on from there).
        """
        if self.processor is None:
            return None
        self.store.wait()
        log.info("rank=%d done at step %d; waiting for the other ranks", self.config.rank, self.step)
        return self.processor.finish(self.step, self)

    # ---- step boundaries -----------------------------------------------------------------

    def begin_step(self) -> None:
        """Called before the step ``self.step + 1`` runs; raises an injected fault there."""
        if self._armed is not None:
            fault, self._armed = self._armed, None
            raise fault
        self._hook_seen = False
        self._gate_seen = self._gate is None

    def end_step(self, meta: Optional[Mapping[str, Any]] = None) -> Optional[int]:
        """Called after step ``self.step + 1`` finished: snapshot, report, obey.

        Returns None to go on, or the step training was rolled back to (the caller
        must continue with the batch after it).
        """
        self.step += 1
        processor = self.processor
        if processor is None:
            return None
        if self._overlap and not self._hook_seen:
            # The optimizer ran without calling our hook (graph mode, or inside ms.jit): a
            # background copy could race with its next update, so copy synchronously.
            log.info("rank=%d optimizer hook not reached (graph mode?): snapshots copy synchronously",
                     self.config.rank)
            self._overlap = False
        if not self._gate_seen:
            # This step ran its collectives without passing the gate (graph mode, ms.jit, or
            # the network was not called): hold the rank at each step's end instead.
            log.info("rank=%d the step did not pass the collective gate: lockstep at the step's end",
                     self.config.rank)
            self._ungate()
            processor.lockstep = True
        self.meta = dict(meta or {})
        before = self.step
        entered = time.perf_counter()
        if self._step_exit is not None:
            # The step's own time: training, not the wait for a capture (that is the capture's cost).
            self.costs.step(entered - self._step_exit - self._hook_wait)
        self._hook_wait = 0.0
        try:
            return self._after(processor.end_step(self.step, self, self._capture), before)
        except ProcessorError as error:
            self.dump_and_exit(-1, f"lost the controller: {error}")
        finally:
            self._step_exit = time.perf_counter()
            if processor.reports_costs:
                figures = self.costs.due(self._step_exit)
                if figures is not None:
                    try:
                        processor.report_cost(*figures)
                    except ProcessorError:
                        pass  # the next end_step finds the controller lost

    def _after(self, resumed: Optional[int], before: int) -> Optional[int]:
        return resumed if resumed is not None and resumed != before else None

    def fault(self, error: BaseException) -> int:
        """An exception escaped step ``self.step + 1``: report it, wait, and return the step rolled back to.

        Re-raises ``error`` when mindft is off, or when the same step keeps failing.
        """
        if self.processor is None:
            raise error
        self._step_exit = None  # the time until training resumes is no step's
        if self._interrupt is not None:
            action, self._interrupt = self._interrupt, None
            try:
                resumed = self.processor.follow(self, action)
            except ProcessorError as lost:
                self.dump_and_exit(-1, f"lost the controller: {lost}")
            return self.step if resumed is None else resumed
        step = self.step + 1
        kind = classify(error)
        count = self._faults_at.get(step, 0) + 1
        self._faults_at = {step: count}
        if count > MAX_FAULTS_PER_STEP:
            log.error("rank=%d step %d failed %d times in a row; giving up", self.config.rank, step, count - 1)
            self._dump_quietly(-1, f"step {step} keeps failing: {describe(error)}")
            raise error
        log.warning("rank=%d fault %s inside step %d: %s", self.config.rank, kind.name, step, describe(error))
        try:
            self.processor.report_fault(kind, describe(error), step)
            resumed = self.processor.follow(self)
        except ProcessorError as lost:
            self.dump_and_exit(-1, f"lost the controller while reporting {kind.name}: {lost}")
        return self.step if resumed is None else resumed

    # ---- RankHooks: what the flow asks of this rank ----------------------------------------

    def settle(self) -> Tuple[int, ...]:
        """Let the capture in flight finish; a failed one is logged and simply not held."""
        try:
            self.store.wait()
        except SnapshotError as error:
            log.error("rank=%d %s", self.config.rank, error)
        return self.store.steps

    def restore(self, step: int) -> Tuple[int, ...]:
        """Put the snapshot of ``step`` back into the parameters, RNG and data position."""
        self._rollback_started = time.perf_counter()
        self.settle()
        try:
            meta = self.state.load(self.store, step)
        except SnapshotError as error:
            self.dump_and_exit(-1, f"cannot restore step {step}: {error}")
        set_rng(meta)
        if self._replication is not None:
            self._replication.restored(step)
        self.meta = dict(meta)
        self.step = self.resumed_from = step
        self.last_recovery = {"restore_s": time.perf_counter() - self._rollback_started}
        log.warning("rank=%d restored step %d", self.config.rank, step)
        return self.store.steps

    def resume(self, step: int) -> None:
        """Training goes on after ``step``."""
        self.last_recovery["rollback_to_resume_s"] = time.perf_counter() - self._rollback_started
        log.warning("rank=%d resumed after step %d", self.config.rank, step)

    def arm(self, fault: FaultKind, detail: str) -> None:
        """Raise ``fault`` when the next step begins."""
        self._armed = DeviceFault(fault, detail)

    def leave_device(self, reason: str) -> NoReturn:
        """Exit so the device can be hot-reset: the snapshots stay in the node agent's memory
        (``MINDFT_STATE_DIR``) and the buddy's replica; mindft-launch starts this rank again."""
        held = list(self.store.steps) if self.store is not None else []
        where = "the node agent's memory" if self.config.state_dir is not None else "the buddy's replica only"
        log.warning("rank=%d leaves its device (%s); steps %s stay in %s", self.config.rank, reason, held, where)
        self.close()
        raise SystemExit(ExitCode.LEFT_DEVICE)

    def dump_and_exit(self, step: int, reason: str) -> NoReturn:
        """Write the dying-gasp checkpoint of ``step`` (-1: newest) and exit: 3 if written, 4 if not."""
        path = self._dump_quietly(step, reason)
        log.critical("rank=%d stops: %s; dying-gasp checkpoint: %s", self.config.rank, reason,
                     path or "NOT written")
        self.close()
        raise SystemExit(ExitCode.DUMPED if path is not None else ExitCode.DUMP_FAILED)

    # ---- snapshots -----------------------------------------------------------------------

    def _capture(self, step: int) -> None:
        started = time.perf_counter()
        if self._overlapped_capture:
            # The previous capture copied in the background: count its copy whole (on a busy
            # machine the overlap hides little of it), plus what it blocked synchronously.
            self.store.wait()
            self.costs.capture(self._overlapped_capture + self.store.last_fill_seconds + self._replica_cost())
            self._overlapped_capture = 0.0
            started = time.perf_counter()
        meta = {"step": step, **self.meta, **rng_meta()}
        seq = self.store.capture(step, self.state.arrays(), meta)
        if self._replication is not None:
            # Streamed to the buddy in the background once complete; only this step's report
            # waits for it to arrive (RankReplication.reportable), never the training.
            self._replication.captured(seq, step)
        if not self._overlap:
            self.store.wait()
        else:
            self._overlapped_capture = max(time.perf_counter() - started, 1e-9)
            return
        self.costs.capture(time.perf_counter() - started + self._replica_cost())

    def _replica_cost(self) -> float:
        """The CPU this process's replication (sending this rank's replica, keeping the buddy's)
        takes per snapshot, for it runs beside training on the same cores; at least a push's
        duration, for a step report waits for its replica: the cadence must leave it time."""
        sender = None if self._replication is None else self._replication.sender
        return 0.0 if sender is None else max(sender.replica_cost or 0.0, sender.push_seconds or 0.0)

    def _before_update(self, cell: Any, inputs: Any) -> None:
        """Optimizer forward pre-hook: the parameters must not change while they are copied."""
        self._hook_seen = True
        if self.store is not None:
            started = time.perf_counter()
            self.store.wait()
            self._hook_wait += time.perf_counter() - started
        return None

    def _start_replication(self) -> None:
        """Stream this rank's snapshots to its buddy's keeper; its step reports wait for them."""
        self._replication = RankReplication.attach(self.processor, self.store, self._buddy,
                                                   self.config.timeouts.dead_after, self._keys, self._replication_cpu)

    def _gate_collectives(self) -> None:
        """Lockstep without a wait on the step: instead of holding the rank at the end of step
        ``s`` until every rank finished it (a controller round trip per step), hold it just
        before the all-reduce of step ``s + 1``, which its forward (and backward) pass has
        overlapped with the round trip. A rank that faults after its all-reduce still finds every
        peer short of the next all-reduce; a peer the controller pauses there abandons its step
        (nothing applied yet) and replays it after the recovery. PyNative only (hooks)."""
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            return
        gate = collective_gate(self.state.cell, self._optimizer)
        if gate is None:
            return
        cell, before = gate
        if before:
            self._gate = cell.register_forward_pre_hook(lambda c, inputs: self._pass_gate())
        else:
            self._gate = cell.register_forward_hook(lambda c, inputs, outputs: self._pass_gate())
        self.processor.lockstep = False
        log.info("rank=%d lockstep before the collectives (%s of %s)", self.config.rank,
                 "pre-hook" if before else "hook", type(cell).__name__)

    def _ungate(self) -> None:
        if self._gate is not None:
            self._gate.remove()
            self._gate = None
        self._gate_seen = True

    def _pass_gate(self) -> None:
        """Before this step's collectives: wait until every rank finished the previous step."""
        if self._gate_seen or self.processor is None:
            return None  # once per step (a network called again in the same step passes)
        self._gate_seen = True
        started = time.perf_counter()
        action = self.processor.wait_peers(self.step)
        self._hook_wait += time.perf_counter() - started
        if action is not None:
            self._interrupt = action
            log.warning("rank=%d step %d interrupted before its collectives by %s", self.config.rank,
                        self.step + 1, action.kind.name)
            raise StepInterrupted(self.step + 1)
        return None

    def _adopt_replica(self) -> bool:
        """A restarted rank takes its state back from its buddy's replica keeper.

        It must know its held steps before it registers, so it asks the controller
        where its buddy serves replicas with a status request first.
        """
        config, buddy = self.config, self._buddy
        if buddy is None:
            return False
        try:
            status = request(config.controller_address, self._keys, StatusRequest(), config.timeouts.dead_after)
        except ControllerUnreachable as error:
            log.error("rank=%d restarted but cannot ask the controller for replica endpoints: %s",
                      config.rank, error)
            return False
        endpoint = next((r.replica_endpoint for r in getattr(status, "ranks", ()) if r.rank == buddy), "")
        if not endpoint:
            log.error("rank=%d restarted but the controller knows no replica endpoint of buddy rank %d",
                      config.rank, buddy)
            return False
        try:
            snapshot = fetch_replica(endpoint, config.rank, self._keys, config.timeouts.dead_after * 2)
        except SnapshotError as error:
            log.error("rank=%d could not fetch its replica from rank %d: %s", config.rank, buddy, error)
            return False
        self.store.adopt(snapshot)
        log.warning("rank=%d adopted its replica of step %d from rank %d", config.rank, snapshot.step, buddy)
        return True

    def _dump_quietly(self, step: int, reason: str) -> Optional[Path]:
        if self.store is None:
            return None
        try:
            path = self.store.dump(self.config.dump_dir, self.config.rank, self.config.world_size, step)
        except SnapshotError as error:
            log.error("rank=%d dying-gasp dump failed: %s", self.config.rank, error)
            return None
        log.error("rank=%d wrote its dying-gasp checkpoint %s (%s)", self.config.rank, path, reason)
        return path


def optimizer_of(network: nn.Cell) -> Optional[nn.Cell]:
    """The optimizer Cell inside a train network (``TrainOneStepCell.optimizer`` or a search)."""
    found = getattr(network, "optimizer", None)
    if isinstance(found, nn.Optimizer):
        return found
    for _, cell in network.cells_and_names():
        if isinstance(cell, nn.Optimizer):
            return cell
    return None


