"""The framework-neutral rank engine: one rank's part in the recovery flow.

Two layers, driven by the MindSpore adapter (:mod:`mindft.mindspore._session`), the fake test
rank (``tests/fake_rank.py``) and the benchmarks:

* :class:`RankLoop`, the driver loop over the rank's :class:`~mindft.rank.processor.Processor`:
  join (register; a restarted rank follows the recovery), the end of each step (the capture
  window, the step report, lockstep, a pending action), a fault inside a step (reported, or
  given up when the step keeps failing), finish (Done, then wait for every rank), the costs.
  It carries the flow's commands out through the rank's :class:`~mindft.flow.follower.RankHooks`.
* :class:`RankEngine`, those RankHooks over a :class:`~mindft.snapshot.store.SnapshotStore` (in the
  node agent's memory when mindft-launch gives one), the replication of its snapshots to a buddy
  rank's keeper when no node agent replicates them (:mod:`mindft.replica`), the dying-gasp
  dump and leaving the device. The framework's state comes in through :class:`StateHooks`.

Steps are counted from 1 (``step`` = number of optimizer updates done); the snapshot of step 0
is the state training starts from, so a fault in the very first step can be rolled back too.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, NoReturn, Optional, Protocol, Sequence, Tuple

import numpy as np

from mindft.rank.agent_watch import AgentWatch, exit_now
from mindft.net.channel import ControllerUnreachable, request
from mindft.config import ConfigError, MindftConfig, load_config
from mindft.exitcodes import ExitCode
from mindft.rank.faults import DeviceFault, classify, describe
from mindft.flow.follower import CostMeter, Finished, RankHooks, Resumed, joins_recovery
from mindft.flow.episode import retried
from mindft.flow.topology import rank_buddy
from mindft.net.keys import job_keys
from mindft.rank.processor import Processor, ProcessorError
from mindft.protocol import Action, FaultKind, RegisterAck, StatusRequest
from mindft.replica import Keeper, RankReplication, fetch_replica, replica_spill, store_slots
from mindft.snapshot.store import SnapshotError, SnapshotStore
from mindft.observe.threadcpu import ThreadCpu

log = logging.getLogger(__name__)


class StepKeepsFailing(RuntimeError):
    """The same step failed more than ``MAX_FAULTS_PER_STEP`` times in a row: not transient."""

    def __init__(self, step: int, times: int) -> None:
        super().__init__(f"step {step} failed {times} times in a row")
        self.step = step
        self.times = times


class RankLoop:
    """The rank-side driver loop over ``processor``, obeying through ``hooks`` (module docstring).

    A controller lost while the loop talks to it ends the rank through ``hooks.dump_and_exit``.
    With :attr:`lockstep` the rank waits at the end of each step until every rank finished it:
    in a job whose collectives cannot be repaired in place, a rank that faults at a step
    boundary then finds every peer at the same boundary (not blocked in the next step's
    all-reduce), so the recovery rolls back in place instead of restarting every worker.
    """

    def __init__(self, processor: Processor, hooks: RankHooks) -> None:
        self.processor = processor
        self.hooks = hooks
        self.rank = processor.rank
        self.lockstep = False
        self.finished_job = False  # FINISH received: every rank is done
        self.costs = CostMeter()

    def join(self, held: Sequence[int], restarted: bool, adopted: bool = True, collectives: bool = False) -> bool:
        """:meth:`register`, then :meth:`rejoin`: True when the rank followed a recovery."""
        return self.rejoin(self.register(held, collectives), restarted, adopted, held)

    def register(self, held: Sequence[int], collectives: bool = False) -> RegisterAck:
        """Register with the steps ``held`` and wait at the start barrier (a restarted rank is
        answered at once). Exits FAILED when the controller never answers or ends the job."""
        try:
            return self.processor.register(held_steps=held, collectives=collectives)
        except ProcessorError as error:
            log.critical("%s", error)
            self.processor.close()
            raise SystemExit(ExitCode.FAILED) from None

    def rejoin(self, ack: RegisterAck, restarted: bool, adopted: bool, held: Sequence[int]) -> bool:
        """A restarted rank that holds state of its own (``adopted``), or finds the job
        recovering, follows the recovery until RESUME. True when it did."""
        if not joins_recovery(restarted, adopted, ack.state):
            return False
        log.warning("rank=%d restarted holding %s; waiting for ROLLBACK", self.rank, list(held))
        self.follow()
        return True

    def follow(self, action: Optional[Action] = None) -> Optional[int]:
        """Obey the controller from ``action`` (or the next one) until training may go on.

        Returns the step training resumes after (a RESUME), or None when an injected fault was
        armed outside a recovery or the job finished (:attr:`finished_job` tells which).
        """
        processor = self.processor
        try:
            while True:
                if action is None:
                    action = processor.wait_action()
                log.info("rank=%d %s step=%d round=%d", self.rank, action.kind.name, action.step, action.round)
                with processor.report_lock:  # not held while the hooks run: the replication's thread releases
                    processor.follower.forget_reports()
                ack, outcome = processor.follower.obey(action, self.hooks)
                if ack is not None:
                    processor.send(ack)
                if isinstance(outcome, Resumed):
                    return outcome.step
                if isinstance(outcome, Finished):
                    self.finished_job = True
                    return None
                if outcome is not None:
                    return None
                action = None
        except ProcessorError as error:
            self._give_up(str(error))

    def end_step(self, step: int, capture: Callable[[int], None]) -> Optional[int]:
        """The end of ``step``: on a capture step wait for the window and ``capture(step)``, then
        report the step and obey a pending action. Returns the step a recovery rolled training
        back to (or resumed after), None to go straight on."""
        processor = self.processor
        try:
            if processor.follower.is_capture_step(step):
                while (action := processor.wait_window(step)) is not None:
                    resumed = self.follow(action)
                    if resumed is not None:
                        return resumed
                capture(step)
            processor.finished(step)
            if self.lockstep:
                while (action := processor.wait_peers(step)) is not None:
                    resumed = self.follow(action)
                    if resumed is not None:
                        return resumed
                return None
            action = processor.poll_action()
        except ProcessorError as error:
            self._give_up(str(error))
        return None if action is None else self.follow(action)

    def _give_up(self, reason: str) -> NoReturn:
        """The job is out of reach: the dying gasp of the step every rank holds, as last heard
        (its newest when it no longer holds that one: no progress was heard before the loss)."""
        step = self.processor.follower.orphan_step()
        self.hooks.dump_and_exit(step if step in self.hooks.settle() else -1, reason)

    def fault(self, kind: FaultKind, detail: str, step: int, since: Optional[float] = None) -> Optional[int]:
        """A fault of ``kind`` inside ``step``, caught at ``since`` (``time.monotonic()``; default:
        now): report it and follow the recovery. Returns what :meth:`follow` returns; raises
        :class:`StepKeepsFailing` instead of replaying a step yet again."""
        follower = self.processor.follower
        if not follower.on_fault(step):
            raise StepKeepsFailing(step, follower.faults_in_a_row - 1)
        log.warning("rank=%d fault %s inside step %d: %s", self.rank, kind.name, step, detail)
        try:
            self.processor.report_fault(kind, detail, step, since)
        except ProcessorError as lost:
            self._give_up(f"lost the controller while reporting {kind.name}: {lost}")
        return self.follow()

    def finish(self, step: int) -> Optional[int]:
        """Report Done at ``step`` and wait for every rank: None when the job is finished, or
        the step to continue training after when a late fault rolled everyone back."""
        try:
            self.processor.done(step)
        except ProcessorError as error:
            self._give_up(str(error))
        while not self.finished_job:
            resumed = self.follow()
            if resumed is not None:
                return resumed
        return None

    def report_costs(self, now: float) -> None:
        """Report the measured costs when the job chooses the cadence and they are worth it."""
        if not self.processor.reports_costs:
            return
        figures = self.costs.due(now)
        if figures is not None:
            try:
                self.processor.report_cost(*figures)
            except ProcessorError:
                pass  # the next end_step finds the controller lost


class StateHooks(Protocol):
    """The framework's state, as the engine snapshots and restores it."""

    def arrays(self) -> Mapping[str, np.ndarray]:
        """The current values (views allowed: nothing changes them while a capture reads them)."""

    def load(self, store: SnapshotStore, step: int) -> Mapping[str, Any]:
        """Put the snapshot of exactly ``step`` back in place; return its meta."""


def replica_buddy(config: MindftConfig) -> Optional[int]:
    """The rank that holds this rank's replica (MINDFT_REPLICA_BUDDY; default the next rank),
    None when there is none (:func:`~mindft.flow.topology.rank_buddy`): alone, or on one node
    where the node agent's memory holds the state."""
    return rank_buddy(config.rank, config.world_size, config.replica_buddy)


class RankEngine:
    """One rank's part in the recovery flow over a snapshot store (see the module docstring);
    the rank's RankHooks.

    ``snapshot_every=N`` captures (and replicates) only every N-th step: every rank of a job
    must use the same N; a fault then replays up to N steps (CheckFreq's trade). Without it
    (and without MINDFT_SNAPSHOT_EVERY) the job chooses N within the overhead budget from what
    this rank measures and reports. With :attr:`overlap` (set by a front end whose optimizer
    waits for the copy) a capture completes in the background during the next step.
    Subclasses add to each snapshot's meta (:meth:`capture_meta`) and put it back
    (:meth:`restored_meta`).
    """

    def __init__(self, state: StateHooks, config: Optional[MindftConfig] = None,
                 snapshot_every: Optional[int] = None) -> None:
        if snapshot_every is not None and snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.config = config if config is not None else load_config()
        self._snapshot_every = snapshot_every
        self.snapshot_every = snapshot_every or self.config.snapshot_every or 1  # the initial cadence
        self.state = state
        self.enabled = self.config.tft.enabled
        self.step = 0
        self.meta: Dict[str, Any] = {}
        self.resumed_from: Optional[int] = None
        self.processor: Optional[Processor] = None
        self.loop: Optional[RankLoop] = None
        self.store: Optional[SnapshotStore] = None
        self.overlap = False
        self.costs = CostMeter()  # the loop's once joined (it reports what this measures)
        self._keeper: Optional[Keeper] = None  # holds the replica of the rank whose buddy this one is
        self._replication: Optional[RankReplication] = None  # streams this rank's snapshots to its buddy
        self._replication_cpu = ThreadCpu()  # the keeper's and the replication's threads: the budget counts them
        self._buddy = replica_buddy(self.config)
        self._keys = None
        self._armed: Optional[DeviceFault] = None
        self._step_exit: Optional[float] = None  # when end_step last returned (training resumed)
        self._hook_wait = 0.0  # seconds this step waited for a capture or for its peers (not the step's cost)
        self._overlapped_capture = 0.0  # the synchronous part of an overlapped capture still copying
        self._interrupt: Optional[Action] = None  # an action that interrupted the step before its collectives
        self._rollback_started = 0.0
        self._agent_watch: Optional[AgentWatch] = None
        self.last_recovery: Dict[str, float] = {}
        if not self.enabled:
            log.info("rank=%d mindft off (MS_ENABLE_TFT=%r enables nothing): training runs unprotected",
                     self.config.rank, os.environ.get("MS_ENABLE_TFT", ""))

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, meta: Optional[Mapping[str, Any]] = None, collectives: bool = False) -> int:
        """Join the job; restore this rank if it is a restarted one. Returns the step to continue
        after. ``collectives``: the ranks share a communicator a restarted process cannot rejoin."""
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
        if config.launcher_pid:
            self._agent_watch = AgentWatch(config.launcher_pid, self._agent_gone)
        self.loop = RankLoop(self.processor, self)
        self.loop.costs = self.costs
        self.loop.lockstep = collectives  # a fault at a boundary then rolls back in place
        try:
            ack = self.loop.register(self.store.steps, collectives)
        except SystemExit:
            self.close()
            raise
        if self._buddy is not None:
            self._start_replication()
        if not self.loop.rejoin(ack, restarted, adopted, self.store.steps):
            self.meta = dict(meta or {})
            self._capture(self.step)
            self.store.wait()
        return self.step

    def close(self) -> None:
        """Leave the job: stop the replication and the processor, free the snapshots (idempotent)."""
        if self._agent_watch is not None:
            self._agent_watch.close()
            self._agent_watch = None
        if self._replication is not None:
            self._replication.close()
            self._replication = None
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
        return self.loop.finish(self.step)

    def _agent_gone(self, pid: int, ending: threading.Event) -> None:
        """The node agent (``pid``) is gone (the agent watch's thread): nothing restarts this rank
        or keeps its snapshots any more. The training thread ends it with its dying gasp at its
        next step boundary; when it has not begun to after ``timeouts.dead_after`` (blocked in a
        collective whose peer is gone), this thread writes it and ends the process."""
        log.error("rank=%d its node agent (pid %d) is gone: the rank ends with its dying gasp", self.config.rank, pid)
        processor = self.processor
        if processor is None:
            return
        processor.fail(f"rank {self.config.rank}: its node agent (pid {pid}) is gone")
        if ending.wait(self.config.timeouts.dead_after):
            return
        step, store = processor.follower.orphan_step(), self.store
        held = store.steps if store is not None else ()
        path = self._dump_quietly(step if step in held else -1, "its node agent is gone; training is blocked")
        exit_now(ExitCode.DUMPED if path is not None else ExitCode.DUMP_FAILED)

    # ---- step boundaries -----------------------------------------------------------------

    def begin_step(self) -> None:
        """Called before the step ``self.step + 1`` runs; raises an injected fault there."""
        if self._armed is not None:
            fault, self._armed = self._armed, None
            raise fault

    def end_step(self, meta: Optional[Mapping[str, Any]] = None) -> Optional[int]:
        """Called after step ``self.step + 1`` finished: snapshot, report, obey.

        Returns None to go on, or the step training was rolled back to (the caller must
        continue with the batch after it).
        """
        self.step += 1
        if self.processor is None:
            return None
        self.meta = dict(meta or {})
        before = self.step
        entered = time.perf_counter()
        if self._step_exit is not None:
            # The step's own time: training, not the wait for a capture (that is the capture's cost).
            self.costs.step(entered - self._step_exit - self._hook_wait)
        self._hook_wait = 0.0
        try:
            resumed = self.loop.end_step(self.step, self._capture)
        finally:
            self._step_exit = time.perf_counter()
            self.loop.report_costs(self._step_exit)
        return resumed if resumed is not None and resumed != before else None

    def fault(self, error: BaseException) -> int:
        """An exception escaped step ``self.step + 1``: report it, wait, and return the step rolled back to.

        Re-raises ``error`` when mindft is off, or when the same step keeps failing.
        """
        if self.processor is None:
            raise error
        caught = time.monotonic()  # the job's detect phase starts here, not once the report is written
        self._step_exit = None  # the time until training resumes is no step's
        if self._interrupt is not None:
            action, self._interrupt = self._interrupt, None
            resumed = self.loop.follow(action)
            return self.step if resumed is None else resumed
        step = self.step + 1
        kind = classify(error)
        if not retried(kind):
            # Said once, with the traceback: the job ends (every rank dumps one step), nothing retries it.
            log.error("rank=%d: the training script raised an exception in step %d, not a device fault; the "
                      "job ends with every rank's dying gasp", self.config.rank, step, exc_info=error)
        try:
            resumed = self.loop.fault(kind, describe(error), step, caught)
        except StepKeepsFailing as failing:
            log.error("rank=%d %s; giving up", self.config.rank, failing)
            self._dump_quietly(-1, f"step {step} keeps failing: {describe(error)}")
            raise error
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
        """Put the snapshot of ``step`` back into the state (and whatever its meta restores)."""
        self._rollback_started = time.perf_counter()
        self.settle()
        try:
            meta = self.state.load(self.store, step)
        except SnapshotError as error:
            self.dump_and_exit(-1, f"cannot restore step {step}: {error}")
        self.restored_meta(meta)
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
        watch = self._agent_watch
        if watch is not None:
            watch.ending.set()  # this thread writes it, not the watch
        path = self._dump_quietly(step, reason)
        log.critical("rank=%d stops: %s; dying-gasp checkpoint: %s", self.config.rank, reason,
                     path or "NOT written")
        orphaned = self.processor is not None and self.processor.broken
        self.close()
        code = ExitCode.DUMPED if path is not None else ExitCode.DUMP_FAILED
        if orphaned or (watch is not None and watch.gone):
            # Nobody would stop a teardown that waits for MindSpore's cluster, which went with the
            # agent, or with the controller's node (MindSpore's scheduler runs there: its Finalize
            # retries unregistering from it for ever).
            exit_now(code)
        raise SystemExit(code)

    # ---- what a front end adds to a snapshot -----------------------------------------------

    def capture_meta(self) -> Dict[str, Any]:
        """Extra JSON-able meta to keep with each snapshot (e.g. a generator's state)."""
        return {}

    def restored_meta(self, meta: Mapping[str, Any]) -> None:
        """Put back what :meth:`capture_meta` recorded, after a restore."""

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
        meta = {"step": step, **self.meta, **self.capture_meta()}
        seq = self.store.capture(step, self.state.arrays(), meta)
        if self._replication is not None:
            # Streamed to the buddy in the background once complete; only this step's report
            # waits for it to arrive (RankReplication.reportable), never the training.
            self._replication.captured(seq, step)
        if not self.overlap:
            self.store.wait()
        else:
            self._overlapped_capture = max(time.perf_counter() - started, 1e-9)
            return
        self.costs.capture(time.perf_counter() - started + self._replica_cost())

    def _replica_cost(self) -> float:
        """The CPU this process's replication (sending this rank's replica, keeping the buddy's)
        takes per snapshot, for it runs beside training on the same cores; at least a push's
        duration, for a step report waits for its replica: the cadence must leave it time. Nothing
        until the sender has a warm figure: the first push, with its connection's set-up, is not
        what the next ones cost (nor its duration, the newest push's until a second is confirmed)."""
        sender = None if self._replication is None else self._replication.sender
        cost = None if sender is None else sender.replica_cost
        return 0.0 if cost is None else max(cost, sender.push_seconds or 0.0)

    def _start_replication(self) -> None:
        """Stream this rank's snapshots to its buddy's keeper; its step reports wait for them."""
        self._replication = RankReplication.attach(self.processor, self.store, self._buddy,
                                                   self.config.timeouts.dead_after, self._keys, self._replication_cpu)

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
