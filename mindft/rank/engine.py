"""The framework-neutral rank engine: one rank's part in the recovery flow.

:class:`RankEngine` is the rank's :class:`~mindft.flow.follower.RankHooks` over a
:class:`~mindft.snapshot.store.SnapshotStore` (in the node agent's memory when mindft-launch gives
one): its snapshots, restores, the dying-gasp dump and leaving the device; the framework's state
comes in through :class:`StateHooks`. Its :class:`~mindft.rank.loop.Coordinator` decides when the
rank stops and where it resumes: mindft's :class:`~mindft.rank.loop.RankLoop` over the rank's
processor (with the replication of the rank's snapshots to a buddy rank's keeper when no node
agent replicates them, :mod:`mindft.replica`), or MindIO's
(:class:`mindft.mindio.loop.MindioLoop`, which a subclass joins through :meth:`RankEngine.join`).
It is driven by the MindSpore adapter (:mod:`mindft.mindspore._session`,
:mod:`mindft.mindspore._mindio_session`) and the benchmarks.

Steps are counted from 1 (``step`` = number of optimizer updates done); the snapshot of step 0
is the state training starts from, so a fault in the very first step can be rolled back too.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Mapping, NoReturn, Optional, Protocol, Tuple

import numpy as np

from mindft.rank.agent_watch import AgentWatch, exit_now
from mindft.net.channel import ControllerUnreachable, request
from mindft.config import ConfigError, MindftConfig, load_config
from mindft.exitcodes import ExitCode
from mindft.rank.faults import DeviceFault, classify, describe
from mindft.flow.follower import CostMeter
from mindft.flow.episode import retried
from mindft.flow.slow import PaceMeter, policy_of
from mindft.flow.topology import rank_buddy
from mindft.net.keys import job_keys
from mindft.rank.loop import Coordinator, GivenUp, RankLoop
from mindft.rank.processor import Processor
from mindft.protocol import FaultKind, StatusRequest
from mindft.replica import Keeper, RankReplication, fetch_replica, replica_spill, store_slots
from mindft.snapshot.store import SnapshotError, SnapshotStore
from mindft.observe.threadcpu import ThreadCpu

log = logging.getLogger(__name__)


class StateHooks(Protocol):
    """The framework's state, as the engine snapshots and restores it."""

    def arrays(self) -> Mapping[str, np.ndarray]:
        """The current values (views allowed: nothing changes them while a capture reads them)."""

    def load(self, store: SnapshotStore, step: int, exact: bool = True) -> Mapping[str, Any]:
        """Put the snapshot of exactly ``step`` back in place; return its meta. ``exact`` False
        (MindIO's repair step, which this rank may never have finished): the newest at or below
        ``step``, its meta's ``step`` the one put back."""


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
        self.loop: Optional[Coordinator] = None  # mindft's RankLoop over the processor, or MindIO's
        self.store: Optional[SnapshotStore] = None
        self.overlap = False
        self.costs = CostMeter()  # the loop's once joined (it reports what this measures)
        self.pace = PaceMeter(policy_of(self.config).report_every)  # own work per step, for slow ranks; the loop's
        self._keeper: Optional[Keeper] = None  # holds the replica of the rank whose buddy this one is
        self._replication: Optional[RankReplication] = None  # streams this rank's snapshots to its buddy
        self._replication_cpu = ThreadCpu()  # the keeper's and the replication's threads: the budget counts them
        self._buddy = replica_buddy(self.config)
        self._keys = None
        self._armed: Optional[DeviceFault] = None
        self._step_exit: Optional[float] = None  # when end_step last returned (training resumed)
        self._hook_wait = 0.0  # seconds this step waited for a capture or for its peers (not the step's cost)
        self._work_end: Optional[float] = None  # when this step reached its collectives (None: not yet, or none)
        self._overlapped_capture = 0.0  # the synchronous part of an overlapped capture still copying
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
        self.join(self.config.restart_count > 0, dict(meta or {}), collectives)
        return self.step

    def join(self, restarted: bool, meta: Dict[str, Any], collectives: bool) -> None:
        """Join through mindft's controller (:attr:`loop`: a :class:`~mindft.rank.loop.RankLoop`):
        the keeper of the buddy's replica, the processor, registration, the replication; a
        restarted rank takes its state back and follows the recovery, a new one captures its
        start. A subclass joins another :class:`~mindft.rank.loop.Coordinator` (MindIO's)."""
        config = self.config
        self.job_keys()
        self.open_store(restarted)
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
        self.loop = loop = RankLoop(self.processor, self)
        loop.costs, loop.pace = self.costs, self.pace
        loop.lockstep = collectives  # a fault at a boundary then rolls back in place
        try:
            ack = loop.register(self.store.steps, collectives)
        except SystemExit:
            self.close()
            raise
        if self._buddy is not None:
            self._start_replication()
        if not loop.rejoin(ack, restarted, adopted, self.store.steps):
            self.capture_start(meta)

    def capture_start(self, meta: Dict[str, Any]) -> None:
        """A rank that starts afresh: snapshot the state training starts from, with ``meta``."""
        self.meta = meta
        self._capture(self.step)
        self.store.wait()

    def job_keys(self) -> Any:
        """The job's CurveZMQ keys (None: plain TCP); exits USAGE when they cannot be read."""
        try:
            self._keys = job_keys(self.config)
        except ConfigError as error:
            log.critical("rank=%d cannot join the job: %s", self.config.rank, error)
            raise SystemExit(ExitCode.USAGE) from None
        return self._keys

    def open_store(self, restarted: bool) -> SnapshotStore:
        """The rank's snapshots, in the node agent's memory when mindft-launch gives one (where a
        restarted rank finds its own again); exits USAGE when the store cannot be opened."""
        try:
            self.store = SnapshotStore(home=self.config.state_dir, resume=restarted)
        except SnapshotError as error:
            log.critical("rank=%d %s", self.config.rank, error)
            raise SystemExit(ExitCode.USAGE) from None
        return self.store

    def close(self) -> None:
        """Leave the job: stop the replication and the coordinator, free the snapshots (idempotent)."""
        if self._agent_watch is not None:
            self._agent_watch.close()
            self._agent_watch = None
        if self._replication is not None:
            self._replication.close()
            self._replication = None
        if self.loop is not None:
            self.loop.close()
            self.loop = None
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
        if self.loop is None:
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
        path = self.dump_quietly(step if step in held else -1, "its node agent is gone; training is blocked")
        exit_now(ExitCode.DUMPED if path is not None else ExitCode.DUMP_FAILED)

    # ---- step boundaries -----------------------------------------------------------------

    def begin_step(self) -> None:
        """Called before the step ``self.step + 1`` runs; raises an injected fault there, or
        what the coordinator raises when it stops the rank (hand either to :meth:`fault`)."""
        if self._armed is not None:
            fault, self._armed = self._armed, None
            raise fault
        if self.loop is not None:
            self.loop.begin_step(self.step)

    def end_step(self, meta: Optional[Mapping[str, Any]] = None) -> Optional[int]:
        """Called after step ``self.step + 1`` finished: snapshot, report, obey.

        Returns None to go on, or the step training was rolled back to (the caller must
        continue with the batch after it).
        """
        self.step += 1
        loop = self.loop  # the rank may leave the job meanwhile (close() drops it)
        if loop is None:
            return None
        self.meta = dict(meta or {})
        before = self.step
        entered = time.perf_counter()
        if self._step_exit is not None:
            # The step's own time: training, not the wait for a capture (that is the capture's cost).
            self.costs.step(entered - self._step_exit - self._hook_wait)
            # Its own work: up to its collectives, where its peers start waiting for it (mindft.flow.slow).
            work_end = self._work_end if self._work_end is not None else entered - self._hook_wait
            self.pace.work(work_end - self._step_exit)
        self._hook_wait, self._work_end = 0.0, None
        try:
            resumed = loop.end_step(self.step, self._capture)
        finally:
            self._step_exit = time.perf_counter()
            loop.report_costs(self._step_exit)
        return resumed if resumed is not None and resumed != before else None

    def reached_collectives(self) -> None:
        """This step's own work is done: its collectives come next (the collective gate calls it)."""
        if self._work_end is None:
            self._work_end = time.perf_counter()

    def fault(self, error: BaseException) -> int:
        """An exception escaped step ``self.step + 1``: report it, wait, and return the step rolled back to.

        Re-raises ``error`` when mindft is off, or when the coordinator gives the step up (the
        same step keeps failing; under MindIO, the training script's own error).
        """
        loop = self.loop
        if loop is None:
            raise error
        caught = time.monotonic()  # the job's detect phase starts here, not once the report is written
        self._step_exit = self._work_end = None  # the time until training resumes is no step's
        if loop.stops(error):
            resumed = loop.recover()
            return self.step if resumed is None else resumed
        step = self.step + 1
        kind = classify(error)
        if not retried(kind):
            # Said once, with the traceback: the job ends (every rank dumps one step), nothing retries it.
            log.error("rank=%d: the training script raised an exception in step %d, not a device fault; the "
                      "job ends with every rank's dying gasp", self.config.rank, step, exc_info=error)
        try:
            resumed = loop.fault(kind, describe(error), step, caught)
        except GivenUp as failing:
            log.error("rank=%d %s; giving up", self.config.rank, failing)
            self.dump_quietly(-1, f"{failing}: {describe(error)}")
            if failing.ends_rank:
                self.close()
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
        try:
            self.put_back(step)
        except SnapshotError as error:
            self.dump_and_exit(-1, f"cannot restore step {step}: {error}")
        if self._replication is not None:
            self._replication.restored(step)
        self.last_recovery = {"restore_s": time.perf_counter() - self._rollback_started}
        log.warning("rank=%d restored step %d", self.config.rank, step)
        return self.store.steps

    def put_back(self, step: int, exact: bool = True) -> int:
        """Let the capture in flight finish, then load the snapshot of ``step`` (``exact`` False:
        the newest at or below it) into the state, with its meta; returns the step put back.
        Raises :class:`~mindft.snapshot.store.SnapshotError` when there is none."""
        self.settle()
        meta = self.state.load(self.store, step) if exact else self.state.load(self.store, step, exact=False)
        self.restored_meta(meta)
        self.meta = dict(meta)
        self.step = self.resumed_from = step if exact else int(meta["step"])
        return self.step

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

    def dump_and_exit(self, step: int, reason: str, written: Optional[Path] = None) -> NoReturn:
        """Write the dying-gasp checkpoint of ``step`` (-1: newest) and exit: 3 if written, 4 if not.
        ``written``: the checkpoint is there already (MindIO's dump handler wrote it)."""
        watch = self._agent_watch
        if watch is not None:
            watch.ending.set()  # this thread writes it, not the watch
        path = written if written is not None else self.dump_quietly(step, reason)
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

    def dump_quietly(self, step: int, reason: str) -> Optional[Path]:
        """Write the dying-gasp checkpoint of ``step`` (-1: newest); its path, None when it failed (logged)."""
        if self.store is None:
            return None
        try:
            path = self.store.dump(self.config.dump_dir, self.config.rank, self.config.world_size, step)
        except SnapshotError as error:
            log.error("rank=%d dying-gasp dump failed: %s", self.config.rank, error)
            return None
        log.error("rank=%d wrote its dying-gasp checkpoint %s (%s)", self.config.rank, path, reason)
        return path
