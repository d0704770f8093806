"""The node agent's rules: what to do with a worker's exit, with the controller's orders, with
MindSpore's scheduler and the reset-file watcher, when the node's part of the job is over, and
which exit code the node ends with.

The node agent (:mod:`mindft.agent.shell`) owns processes; this module owns its decisions. It never
starts or kills anything: :class:`NodePolicy` takes what happened (an exit, an order, the job's
view, the time) and returns what to do as values (:class:`StartWorker`, :class:`KillWorker`,
:class:`~mindft.protocol.ProcessExit` and :class:`~mindft.flow.inputs.SchedulerLost` for the
controller, :class:`AbortJob`, :class:`Say`), which the agent carries out in order.

Who decides a restart: a process that left its device, was stopped for a restart of every
worker, or crashed in a job whose collectives cannot take one restarted process (the job's view
says ``restart_all``) waits for the controller's START; a crash in any other job is restarted
here at once, and reported, so the controller counts it as a fault of that rank. Every exit
that a restart follows costs the rank one of its ``max_restarts`` (a crash, and a stop so that
every worker restarts, as torchrun counts its group's restarts), but a hot reset's: the device
plugin bounds those. What the controller knows decides the rest: a job that has not started
(a rank that dies before every rank registered would die again: the job fails), or that ended.

A warm spare (``mindft-launch --spare``) runs no rank until the controller gives it a lost node
(:mod:`mindft.flow.spares`): it then becomes that node's agent (:meth:`NodePolicy.adopt`) and
starts its ranks as a launcher started again for the node would. An agent whose node was given
to another agent runs nothing of the job any more (:meth:`NodePolicy.replaced`) and waits as a
spare. A spare ends with the job, or when the controller is gone.

MindSpore's scheduler (node 0) is a member of the job: once it formed the cluster, its death
while the ranks train is reported to the controller, which restarts every worker behind a new
one (the agent starts it before the first worker), up to ``max_restarts`` losses; a scheduler
that exits before any worker joined it, or in a job without a controller, fails the job.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from mindft.exitcodes import ExitCode, describe_exit
from mindft.flow.agent_effects import AbortJob, AgentEffect, BecomeSpare, Ending, KillWorker, Say, StartWorker
from mindft.flow.inputs import SchedulerLost
from mindft.protocol import JobState, JobView, OrderKind, ProcessExit, RankOrder

__all__ = ["AbortJob", "AgentEffect", "BecomeSpare", "Ending", "KillWorker", "NodePolicy", "Say", "StartWorker",
           "Worker", "WorkerPhase", "job_exit_code", "CONTROLLER_FINISH_TIMEOUT", "DUMP_GRACE_PERIOD"]

_TERMINAL = (JobState.DONE, JobState.FAILED)
_STOPPED_ON_PURPOSE = (ExitCode.DUMPED, ExitCode.DUMP_FAILED)

# How long the node agent waits for what it does not control; named here, documented with the timeouts.
DUMP_GRACE_PERIOD = 60.0          # after the controller finished, for ranks to dump and exit
CONTROLLER_FINISH_TIMEOUT = 15.0  # after the last rank exited, for the controller's verdict



def job_exit_code(controller_code: Optional[int], final_codes: Iterable[Optional[int]]) -> int:
    """Combine the controller's verdict and the ranks' final exit codes into the node's.

    A checkpoint is claimed (3) only when every rank says it wrote one; a rank that could
    not write its own makes the job 4; a crashed rank's code (128+N after signal N) wins
    over a controller that merely agrees the job failed.
    """
    codes = [c for c in final_codes if c is not None]
    if ExitCode.DUMP_FAILED in codes:
        return ExitCode.DUMP_FAILED
    if codes and all(c == ExitCode.DUMPED for c in codes):
        return ExitCode.DUMPED
    if controller_code not in (None, ExitCode.OK):
        return controller_code
    crashed = [c for c in codes if c != ExitCode.OK and c not in _STOPPED_ON_PURPOSE]
    if crashed:
        code = crashed[0]
        return 128 - code if code < 0 else code
    if ExitCode.DUMPED in codes:
        return ExitCode.DUMPED
    return ExitCode.OK


class WorkerPhase(enum.Enum):
    """Where one local rank's process is, as the policy sees it."""

    RUNNING = "running"
    AWAITING_START = "awaiting_start"  # gone; its state is in the agent's memory; the controller starts it
    FINAL = "final"                    # gone for good (done, dumped, out of restarts, stopped)


@dataclass
class Worker:
    """The policy's record of one local rank."""

    rank: int
    phase: WorkerPhase = WorkerPhase.RUNNING
    pid: Optional[int] = None       # its running process (None: none)
    restarts: int = 0               # processes started after the first
    restarts_used: int = 0          # exits a restart follows, but a hot reset's (bounded by max_restarts)
    returncode: Optional[int] = None
    stop_ordered: bool = False      # killed on the controller's order, to wait for its START
    start_ordered: Optional[str] = None  # a START that came while its process was still leaving: the reason
    restore_from: str = ""          # the keeper the START said to restore its replica from first
    restore_rank: int = -1          # whose state it serves, when not the rank's own

    @property
    def final(self) -> bool:
        return self.phase is WorkerPhase.FINAL

    @property
    def awaiting_start(self) -> bool:
        return self.phase is WorkerPhase.AWAITING_START


@dataclass
class NodePolicy:
    """The rules of one node agent (see the module docstring); what depends on time takes ``now``.

    ``spare``: a warm spare, with no ranks until it adopts a lost node.
    ``protected``: fault tolerance is on (off: a failed rank ends the job, as under msrun).
    ``reports``: the controller wants exit reports (not with MindIO's controller, which notices a
    lost rank by its heartbeats). ``runs_controller``: the job's controller runs in this agent, so
    when it finishes the node waits for its ranks to dump and exit.
    """

    ranks: Sequence[int]
    max_restarts: int
    protected: bool = True
    reports: bool = True
    runs_controller: bool = False
    spare: bool = False
    view: Optional[JobView] = None  # the job as the controller last described it (None: not heard yet)
    interrupted: bool = False       # a signal asked this node to stop
    cluster_intact: bool = True     # MindSpore's scheduler still serves the workers it formed
    scheduler_lost: bool = False    # it died: the next start of a worker starts a new one first
    scheduler_losses: int = 0       # its deaths that restarted every worker (bounded by max_restarts)
    workers: dict[int, Worker] = field(default_factory=dict)
    failure: Optional[AbortJob] = None
    starts_over: bool = False       # no START will come any more (see :meth:`no_more_starts`)
    under_way: bool = False         # the job has trained (a view past STARTING came)
    _controller_done_at: Optional[float] = None
    _all_exited_at: Optional[float] = None
    _hello_at: Optional[float] = None  # when this agent last said hello

    def __post_init__(self) -> None:
        self.workers = {rank: Worker(rank) for rank in self.ranks}

    # ---- the job's view ---------------------------------------------------------------------

    @property
    def restart_all(self) -> bool:
        return self.view is not None and self.view.restart_all

    @property
    def job_over(self) -> bool:
        return self.view is not None and self.view.state in _TERMINAL

    @property
    def finished(self) -> bool:
        """Every rank finished training: the controller said the job is DONE."""
        return self.view is not None and self.view.state is JobState.DONE

    @property
    def orphaned(self) -> bool:
        """The controller is gone: this node's ranks ended with their dying gasps (they gave up on
        it) while it never said that the job ended. The controller runs on node 0: that node is gone or cut off."""
        return (not self.runs_controller and not self.job_over
                and any(w.returncode in _STOPPED_ON_PURPOSE for w in self.workers.values()))

    @property
    def writes_dying_gasp(self) -> bool:
        """The job cannot continue: the agent writes what it holds (:mod:`mindft.flow.gasp`)."""
        return self.protected and not self.spare and (self.orphaned or (self.view is not None
                                                                         and self.view.state is JobState.FAILED))

    def resetting(self, rank: int) -> bool:
        """``rank``'s chip is being reset: however its process ended, a new one would sit on the
        chip and stop the reset, so it waits for the controller's START."""
        return self.view is not None and rank in self.view.resetting

    @property
    def before_start(self) -> bool:
        """The job has not started: no rank trained yet."""
        return self.view is not None and self.view.state is JobState.STARTING and not self.under_way

    @property
    def rebuilding(self) -> bool:
        """A controller started again while the job was under way: it says STARTING until it has
        rebuilt the job (:mod:`mindft.flow.rejoin`)."""
        return self.view is not None and self.view.state is JobState.STARTING and self.under_way

    def on_view(self, view: JobView) -> None:
        """The controller's view of the job (on every transition, and on each hello)."""
        self.view = view
        self.under_way = self.under_way or view.state is not JobState.STARTING

    # ---- processes ----------------------------------------------------------------------------

    def started(self, rank: int, pid: int) -> None:
        """The agent started ``rank``'s process ``pid``."""
        worker = self.workers[rank]
        worker.phase, worker.pid, worker.returncode, worker.stop_ordered = WorkerPhase.RUNNING, pid, None, False
        worker.start_ordered = None

    def running(self) -> list[int]:
        return [r for r, w in self.workers.items() if w.pid is not None]

    def on_exit(self, rank: int, code: int) -> list[AgentEffect]:
        """``rank``'s process exited with ``code``: restart it here, wait for the controller's
        START, or let it go; report it to the controller unless the job cannot use the report."""
        worker = self.workers[rank]
        pid = worker.pid or 0
        worker.pid, worker.returncode = None, code
        out: list[AgentEffect] = [Say(f"rank {rank} (pid {pid}) {describe_exit(code)}")]
        if code == ExitCode.OK or self.interrupted:
            worker.phase = WorkerPhase.FINAL
            return out
        if self.finished:
            # Every rank finished (its final state written and acknowledged): a death now is in
            # MindSpore's own teardown, not a failure of the job.
            worker.phase, worker.returncode = WorkerPhase.FINAL, ExitCode.OK
            return out + [Say(f"rank {rank} died after the job finished (in MindSpore's teardown): not a failure "
                              f"of the job")]
        if not self.protected:
            # Nothing can restore an unprotected rank: stop the job as msrun does.
            worker.phase = WorkerPhase.FINAL
            if self.failure is None:
                self.failure = AbortJob("a rank failed and fault tolerance is off", exit_code=job_exit_code(None, [code]))
                out.append(self.failure)
            return out
        self.cluster_intact = False  # the cluster lost a worker for good
        hot_reset = code == ExitCode.LEFT_DEVICE or self.resetting(rank)
        if hot_reset or worker.stop_ordered:
            # Its state is in the agent's memory: it waits for START (or, the job over, its dying gasp).
            worker.phase = WorkerPhase.AWAITING_START
            if self.job_over:
                return out + [Say(f"rank {rank} stopped; the job is over")]
            if not hot_reset:
                worker.restarts_used += 1
                if worker.restarts_used > self.max_restarts:
                    out.append(Say(f"rank {rank} stopped; it used all {self.max_restarts} restarts (--max-restarts)"))
                    return out + self._report(rank, code, pid, will_restart=False)
            what = "left its device for a hot reset" if code == ExitCode.LEFT_DEVICE else "stopped"
            out.append(Say(f"rank {rank} {what}; it starts again when the controller says"))
            return out + self._report(rank, code, pid, will_restart=True) + self._start_ordered_early(worker)
        if code == ExitCode.REWIND_REQUIRED:
            # Its script cannot go back to the step it restored: a new process would do the same.
            worker.phase = WorkerPhase.FINAL
            out.append(Say(f"not restarting rank {rank}: {describe_exit(code)}"))
            return out + self._report(rank, code, pid, will_restart=False)
        if code in _STOPPED_ON_PURPOSE:
            worker.phase = WorkerPhase.FINAL
            if self.view is not None and not self.job_over:
                # It gave up on its own (not on the controller's order): fail now, not after
                # timeouts.repair, so the other ranks dump while their state is fresh.
                out += self._report(rank, code, pid, will_restart=False)
            return out
        if self.before_start:
            # A rank that dies before every rank registered fails the same way again (a bad
            # script, a missing module): restarting it only hides the error.
            worker.phase = WorkerPhase.FINAL
            return out + self._abort(f"rank {rank} {describe_exit(code)} before the job started; not "
                                     f"restarting it: see its log")
        if self.job_over:
            worker.phase = WorkerPhase.FINAL
            return out + [Say(f"not restarting rank {rank}: the job is over")]
        worker.restarts_used += 1
        if worker.restarts_used > self.max_restarts:
            worker.phase = WorkerPhase.FINAL
            out.append(Say(f"not restarting rank {rank}: it used all {self.max_restarts} restarts"))
            # Fail the job now instead of after timeouts.repair: the healthy ranks dump.
            return out + self._report(rank, code, pid, will_restart=False)
        if self.restart_all or self.rebuilding:
            # Its peers cannot go on without it, or a controller started again rebuilds the job:
            # the controller restarts every worker together.
            worker.phase = WorkerPhase.AWAITING_START
            return out + self._report(rank, code, pid, will_restart=True) + self._start_ordered_early(worker)
        worker.restarts += 1
        out += self._report(rank, code, pid, will_restart=True)
        # Whether the new process finds its state (a peer replica) is the rank's to say.
        return out + [StartWorker(rank, worker.restarts, f"restarting rank {rank} (restart {worker.restarts_used}/"
                                                        f"{self.max_restarts})")]

    def on_order(self, order: RankOrder) -> list[AgentEffect]:
        """The controller's order for one of this node's ranks. Orders may come twice (again on
        each hello while pending): one that no longer applies is ignored."""
        worker = self.workers.get(order.rank)
        if worker is None:
            return [Say(f"the controller addressed rank {order.rank} to this node, which does not run it")]
        if order.kind is OrderKind.KILL:
            if worker.pid is None or (order.pid and order.pid != worker.pid):
                return []  # gone already, or a newer process than the one meant
            worker.stop_ordered = worker.stop_ordered or not order.restart
            then = ("so it can restart" if order.restart else "(the job is over)" if self.job_over
                    else "(it starts again when the controller says)")
            return [Say(f"controller: rank {order.rank} (pid {worker.pid}): {order.reason}; killing it {then}"),
                    KillWorker(order.rank, worker.pid, order.reason)]
        if self.interrupted:
            return []
        if order.restore_from:
            worker.restore_from, worker.restore_rank = order.restore_from, order.restore_rank
        if worker.pid is not None:
            if order.pid and order.pid == worker.pid:
                # The process the controller saw leave has not exited here yet (the rank said
                # goodbye first): start the next one once it has.
                worker.start_ordered = order.reason
            return []  # else a late or repeated order for a process started since
        if not worker.awaiting_start:
            return []
        return self._start(worker, order.reason)

    def _start_ordered_early(self, worker: Worker) -> list[AgentEffect]:
        reason, worker.start_ordered = worker.start_ordered, None
        return [] if reason is None else self._start(worker, reason)

    def _start(self, worker: Worker, reason: str) -> list[AgentEffect]:
        """Carry out the controller's START for a rank awaiting it."""
        if worker.restarts_used > self.max_restarts:
            worker.phase = WorkerPhase.FINAL
            return ([Say(f"not starting rank {worker.rank}: it used all {self.max_restarts} restarts "
                         f"(--max-restarts)")]
                    + self._report(worker.rank, worker.returncode or ExitCode.FAILED, 0, will_restart=False))
        worker.restarts += 1
        renew = not self.running() and (self.scheduler_lost or (self.restart_all and not self.cluster_intact))
        if renew:
            self.cluster_intact, self.scheduler_lost = True, False
        restore_from, restore_rank, worker.restore_from, worker.restore_rank = (worker.restore_from,
                                                                                worker.restore_rank, "", -1)
        return [StartWorker(worker.rank, worker.restarts, f"controller: {reason}: starting rank {worker.rank} "
                                                          f"(restart {worker.restarts})", renew_cluster=renew,
                            restore_from=restore_from, restore_rank=restore_rank)]

    def on_scheduler_exit(self, pid: int, code: int, why: str, log_path: str, formed: bool) -> list[AgentEffect]:
        """MindSpore's scheduler (``pid``) exited with ``code``; ``why`` is the last error line of
        its log, ``formed`` whether every worker had joined it.

        Once it formed the cluster, its death while the ranks train restarts every worker behind a
        new one (the controller decides; up to ``max_restarts`` times, then the job fails with
        dying gasps). It fails the job at once when it exits before any worker joined (a script
        that never calls init() leaves it to time out), in a job without mindft's controller,
        before the job started or after it finished; it only says so once the job failed (the
        ranks write their dying gasps) or when it was no longer needed."""
        what = f"MindSpore's scheduler (pid {pid}) {describe_exit(code)}"
        cause = why or "no error line in its log"
        if code == ExitCode.OK or all(w.final for w in self.workers.values()):
            return [Say(what)]
        if not formed:
            # Its own verdict (not a signal) that the workers never came: a script without init().
            hint = ("; a script that never calls mindspore.communication.init() runs with --no-scheduler"
                    if code > 0 and ("timed out" in why or "not successfully spawned" in why) else "")
            return self._abort(f"{what} before every worker joined it ({cause}); see {log_path}{hint}")
        if self.view is not None and self.view.state is JobState.FAILED:
            return [Say(f"{what} ({cause}) after the job failed; the ranks write their dying gasps")]
        if not (self.protected and self.reports) or self.view is None or self.before_start or self.job_over:
            return self._abort(f"{what}: the ranks cannot communicate without it ({cause}); see {log_path}")
        if self.restart_all and not self.cluster_intact and not self.running():
            # Every worker is stopped for a restart: a new scheduler starts with them anyway.
            self.scheduler_lost = True
            return [Say(f"{what} while every worker restarts ({cause}); a new one starts with them")]
        self.cluster_intact, self.scheduler_lost = False, True
        self.scheduler_losses += 1
        if self.scheduler_losses > self.max_restarts:
            return [Say(f"{what} ({cause}; see {log_path}); not starting a new one: it was lost "
                        f"{self.scheduler_losses} times (--max-restarts {self.max_restarts})"),
                    SchedulerLost(pid, code, why, will_restart=False)]
        return [Say(f"{what} ({cause}; see {log_path}): every worker restarts behind a new scheduler (restart "
                    f"{self.scheduler_losses}/{self.max_restarts})"),
                SchedulerLost(pid, code, why)]

    def hello_due(self, now: float, in_process: bool, interval: float) -> bool:
        """Whether to tell the controller now what this agent runs and holds (from that a controller
        started again rebuilds the job): on a link every ``interval``, as the answer repeats an order
        lost with a connection; in the controller's process once, as nothing is lost in-process."""
        if self._hello_at is not None and (in_process or now - self._hello_at < interval):
            return False
        self._hello_at = now
        return True

    def hello_again(self) -> None:
        """Say hello at once (to a controller this agent just followed, or started)."""
        self._hello_at = None

    def scheduler_moved(self) -> None:
        """MindSpore's scheduler runs on this node from now on (its standby controller took over): the
        next start of a worker starts it first."""
        self.scheduler_lost = True

    def abort(self, reason: str) -> list[AgentEffect]:
        """The agent itself cannot go on (a dead watcher, a node that cannot rejoin)."""
        return self._abort(reason)

    # ---- a node that replaces a lost one, spares ------------------------------------------------

    def adopt(self, ranks: Sequence[int]) -> None:
        """This spare became the agent of a lost node that runs ``ranks`` (:class:`~mindft.protocol.AdoptNode`):
        from now on the rules of that node's agent; its ranks start as :meth:`rejoin` says."""
        self.ranks, self.spare = tuple(ranks), False
        self.workers = {rank: Worker(rank) for rank in self.ranks}
        self._hello_at = None  # say hello as the node at once

    def resize(self, ranks: Sequence[int], why: str) -> list[AgentEffect]:
        """The job goes on in a new world (:class:`~mindft.protocol.WorldResize`, :mod:`mindft.flow.elastic`):
        this node's processes were stopped, and it runs ``ranks`` from now on, in order the next
        incarnations of its ranks before (their restarts go on). They start with every worker on the
        controller's order, in a new MindSpore cluster (its scheduler is renewed before the first)."""
        before = list(self.workers.values())
        self.ranks = tuple(ranks)
        self.workers = {rank: Worker(rank, WorkerPhase.AWAITING_START) for rank in self.ranks}
        for worker, old in zip(self.workers.values(), before):  # a spare that joins has none before
            worker.restarts, worker.restarts_used = old.restarts, old.restarts_used
        self.cluster_intact, self.scheduler_lost, self.spare = False, True, False
        self._hello_at = None
        renamed = ", ".join(f"{old.rank}→{rank}" for old, rank in zip(before, self.ranks) if old.rank != rank)
        return [Say(f"controller: {why}; this node's ranks {list(self.ranks)}"
                    + (f" (renumbered {renamed})" if renamed else "")
                    + " start with every worker from this node's memory when the controller says")]

    def replaced(self, reason: str, controller: str = "") -> list[AgentEffect]:
        """This agent's node was given to another agent, or the controller it ran stood down for the
        one at ``controller`` (:class:`~mindft.protocol.Replaced`): it runs nothing of the job any more
        and becomes a spare."""
        return [] if self.spare else [Say(f"controller: {reason}"), BecomeSpare(reason, controller)]

    def spare_again(self) -> None:
        """Every process of the node this agent ran is gone (:class:`BecomeSpare`): it is a spare now,
        and learns the job anew from the controller it follows."""
        self.ranks, self.spare, self.workers = (), True, {}
        self.runs_controller, self.view, self.under_way = False, None, False
        self._hello_at = None

    def controller_silent(self, silent_for: float, limit: float) -> list[AgentEffect]:
        """A spare whose controller said nothing for ``limit`` seconds leaves: no job will give it a node.
        (An agent with ranks leaves with them: they give up on the controller and write their dying gasps.)"""
        if not self.spare or silent_for <= limit:
            return []
        return self._abort(f"the controller said nothing for {silent_for:.0f} s (> {limit:g} s): this spare leaves")

    @property
    def may_replace_lost_node(self) -> bool:
        """Only an agent that reports to mindft's controller on another node asks at its start
        whether it replaces a lost node (node 0's runs the controller; MindIO's job has none)."""
        return self.reports and not self.runs_controller

    @staticmethod
    def replaces_lost_node(state: JobState, known_ranks: Iterable[int], local_ranks: Iterable[int],
                           node: int = 0, nodes: int = 0) -> bool:
        """An agent that starts while the job already runs with its ranks replaces a lost node; so does,
        as far as it can tell, one for a node beyond the job's world of ``nodes`` (an elastic job that
        went on without it): the job answers whether it has the node (:mod:`mindft.flow.elastic`)."""
        beyond = 0 < nodes <= node
        return state not in (JobState.STARTING, *_TERMINAL) and (beyond or bool(set(known_ranks) & set(local_ranks)))

    def rejoin(self, incarnations: dict[int, int]) -> list[AgentEffect]:
        """After reporting the lost node (:meth:`replaces_lost_node`): start its ranks as new
        incarnations, now, or with every worker on the controller's order; none if the job ended."""
        if self.view is not None and self.view.state in _TERMINAL:
            for worker in self.workers.values():
                worker.phase = WorkerPhase.FINAL
            return self._abort(f"the job ended before this node's ranks could rejoin it: {self.view.reason}")
        out: list[AgentEffect] = []
        together = self.restart_all or self.rebuilding
        for rank, worker in self.workers.items():
            worker.restarts = incarnations.get(rank, 0)
            worker.phase = WorkerPhase.AWAITING_START
            if not together:
                worker.restarts += 1
                out.append(StartWorker(rank, worker.restarts, f"rank {rank} rejoins the job on this node"))
        if together:
            out.append(Say(f"rank(s) {list(self.workers)} start with every worker, when the controller says"))
        return out

    # ---- the end -------------------------------------------------------------------------------

    def ending(self, now: float, controller: Optional[int]) -> Optional[Ending]:
        """Whether the node's part of the job is over at ``now``; ``controller`` is the exit code
        of the controller this agent runs once it finished (None: none, or still running)."""
        running = self.running()
        if self.failure is not None:
            if self.failure.exit_code is not None:
                return Ending(stop_running=bool(running), reason=self.failure.reason, code=self.failure.exit_code)
            return Ending(ExitCode.FAILED, stop_running=bool(running), reason=self.failure.reason)
        if self.spare:  # it waits for a node until the job ends
            if not self.job_over or running:
                return None
            done = self.view.state is JobState.DONE
            return Ending(ExitCode.OK if done else ExitCode.FAILED,
                          reason="the job is done: this spare was not needed" if done else "")
        if controller is not None:
            if self._controller_done_at is None:
                self._controller_done_at = now
            if not running:
                return Ending(controller)
            if now - self._controller_done_at > DUMP_GRACE_PERIOD:
                return Ending(controller, stop_running=True,
                              reason=f"rank(s) {running} still running {DUMP_GRACE_PERIOD:g}s after the "
                                     f"controller finished")
            return None
        # A rank waiting for a START that will not come (none will once the job is over) is done
        # here: the agent writes its dying gasp from memory.
        no_start = self.starts_over or self.job_over
        if running or not all(w.final or (w.awaiting_start and no_start) for w in self.workers.values()):
            self._all_exited_at = None
            return None
        if self.before_start and self.runs_controller:
            self._abort("every rank exited before registering with the controller: does the script use mindft "
                        "(mindft.mindspore.train, FaultTolerantLoop)?")
            return Ending(ExitCode.FAILED, reason=self.failure.reason)
        if not self.runs_controller:
            return Ending()
        # Every rank is gone: the controller's verdict should follow at once.
        if self._all_exited_at is None:
            self._all_exited_at = now
        if now - self._all_exited_at > CONTROLLER_FINISH_TIMEOUT:
            return Ending(reason=f"every rank exited but the controller has no result after "
                                 f"{CONTROLLER_FINISH_TIMEOUT:g}s", code=job_exit_code(None, self.final_codes())
                          or ExitCode.FAILED)
        return None

    def exit_code(self, ending: Ending) -> int:
        """The node's exit code once ``ending`` was carried out (every rank's final code known):
        a deterministic failure's verdict is the job's, unless a dying gasp could not be written."""
        if ending.code is not None:
            return ending.code
        codes = self.final_codes()
        if self.view is not None and self.view.exit_code >= 0 and ExitCode.DUMP_FAILED not in codes:
            return self.view.exit_code
        return job_exit_code(ending.controller, codes)

    def stopped(self, rank: int, code: int) -> None:
        """``rank``'s process exited as the node stopped everything: no decision, only its code."""
        worker = self.workers[rank]
        worker.pid, worker.returncode, worker.phase = None, code, WorkerPhase.FINAL

    def no_more_starts(self) -> None:
        """No START will come (MindIO's stand-in failed the episode): once nothing runs, the node
        ends, and the ranks waiting for one get their dying-gasp checkpoints from memory."""
        self.starts_over = True

    def without_process(self) -> list[int]:
        """Ranks waiting for a start that will not come now the job ended: the agent writes their
        dying-gasp checkpoints from its memory (:meth:`dumped` records how that went)."""
        return [r for r, w in self.workers.items() if w.awaiting_start and w.pid is None]

    def dumped(self, rank: int, ok: bool) -> None:
        worker = self.workers[rank]
        worker.phase, worker.returncode = WorkerPhase.FINAL, ExitCode.DUMPED if ok else ExitCode.DUMP_FAILED

    def final_codes(self) -> list[Optional[int]]:
        return [w.returncode for w in self.workers.values()]

    def dump_step(self, controller: Optional[int]) -> int:
        """The step the job told every rank to dump (-1: none, or each its newest): ``controller``'s,
        the finished controller's this agent runs (None: none), else the job's last view's."""
        return controller if controller is not None else self.view.dump_step if self.view is not None else -1

    def failure_reason(self, controller: str = "") -> str:
        """Why the job ended, for the dying gasp's manifest (``controller``: the finished controller's)."""
        if controller or (self.view is not None and self.view.reason):
            return controller or self.view.reason
        return "the controller is gone (node 0 lost or cut off)" if self.orphaned else "the job failed"

    # ---- helpers --------------------------------------------------------------------------------

    def _report(self, rank: int, code: int, pid: int, will_restart: bool) -> list[AgentEffect]:
        return [ProcessExit(rank, code, pid, will_restart)] if self.reports else []

    def _abort(self, reason: str) -> list[AgentEffect]:
        if self.failure is not None:
            return []
        self.failure = AbortJob(reason)
        return [self.failure]
