"""The controller's job-wide metrics for Prometheus, through ``prometheus_client``.

A shell, like the controller it serves: nothing here decides anything. Two sources feed one
private :class:`~prometheus_client.CollectorRegistry` per controller:

* what a recovery was (its fault, the rung of the ladder it took, its phases, the steps it
  replayed) is counted when the controller carries out a :class:`~mindft.flow.Transition`
  (:meth:`JobMetrics.transition`, on the controller's serving thread), read from the job
  (:attr:`Job.recovery`, :attr:`Job.history`, :func:`~mindft.flow.phase_times`);
* what the job is now (its state, step, ranks, snapshot cadence, replicas) is read on each
  scrape from the controller's status (:class:`StatusCollector`), which the serving thread
  computes (:meth:`Controller.latest_status`), so the scrape never reads the job's state while
  it changes.

:class:`NodeCollector` adds what only a node agent knows (its ranks' snapshots in its memory, its
replication, its processes' restarts, its warm process), on node 0 to the controller's registry,
on the other nodes to a registry of their own. :class:`MetricsServer` serves a registry over HTTP
(``mindft-launch --metrics-port``); every metric is listed in docs/metrics.md.
"""
from __future__ import annotations

import inspect
import logging
import socket
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mindft.config import ConfigError
from mindft.flow import RECOVERY_STATES, Job, JobState, RankState, Transition, phase_times
from mindft.flow.agent import NodePolicy
from mindft.flow.episode import DYING_GASP, IN_PLACE, RUNGS
from mindft.protocol import FaultKind, StatusReply
from mindft.observe.procfs import proportional_set_size

log = logging.getLogger(__name__)

# A rank whose node was lost has a PROCESS_DIED fault on a lost node: a kind of its own here.
NODE_LOST = "node_lost"
FAULT_KINDS = tuple(kind.value for kind in FaultKind) + (NODE_LOST,)
# The recovery states as phases of the histogram (the time in each, summed over a recovery's rounds).
PHASES = {JobState.PAUSING: "pause", JobState.REPAIRING: "repair", JobState.ROLLBACK: "rollback",
          JobState.RESUMING: "resume"}
# Phases that are no state of the job: from the fault to the recovery's start; from the order to
# leave a chip to the last exit (see :class:`~mindft.flow.episode.Episode`).
DETECT, LEAVE = "detect", "leave"
# From a hot reset's tenth of a second to a node replaced in minutes.
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEPS_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class StatusCollector(Collector):
    """The job as its latest status shows it, read on each scrape.

    ``status`` returns the controller's :class:`StatusReply` (:meth:`Controller.latest_status`,
    thread-safe); it raises when the controller does not answer in time, and the scrape fails
    (an honest ``up == 0`` rather than stale numbers). A bound method is held weakly: the
    controller owns its metrics, which must not keep it (its sockets) alive in a reference cycle.
    """

    def __init__(self, status: Callable[[], StatusReply]) -> None:
        self._status: Callable[[], Optional[Callable[[], StatusReply]]] = (
            weakref.WeakMethod(status) if inspect.ismethod(status) else lambda: status)

    def describe(self) -> Iterable[Metric]:
        return list(_status_families())

    def collect(self) -> Iterable[Metric]:
        status = self._status()
        return [] if status is None else list(_status_families(status()))


def _status_families(status: Optional[StatusReply] = None) -> Iterator[Metric]:
    """The metric families of one status (without samples when ``status`` is None: their description)."""
    state = GaugeMetricFamily("mindft_job_state", "The job's state: 1 for the current one, 0 for the others.",
                              labels=["state"])
    step = GaugeMetricFamily("mindft_job_step", "The step every rank finished (the slowest rank's progress).")
    step_seconds = GaugeMetricFamily("mindft_step_duration_seconds",
                                     "Seconds per training step, the slowest rank's smoothed figure as the cadence "
                                     "uses it (snapshots not counted); absent until a rank reported its costs.")
    ranks = GaugeMetricFamily("mindft_ranks", "Ranks in each state, as the controller sees them.", labels=["state"])
    every = GaugeMetricFamily("mindft_snapshot_every_steps",
                              "The snapshot cadence: every rank snapshots every N-th step (in force from its "
                              "switch step).")
    overhead = GaugeMetricFamily("mindft_snapshot_overhead_ratio",
                                 "The budget's estimate of the snapshots' slowdown at the cadence, by the slowest "
                                 "ranks' figures (0.01: 1%); absent until a rank reported its costs.")
    budget = GaugeMetricFamily("mindft_snapshot_overhead_budget_ratio",
                               "MINDFT_OVERHEAD_BUDGET; absent when MINDFT_SNAPSHOT_EVERY fixes the cadence.")
    over = GaugeMetricFamily("mindft_snapshot_over_budget",
                             "1 when even every MINDFT_MAX_REPLAY_STEPS steps snapshots cost more than the budget.")
    lag = GaugeMetricFamily("mindft_rank_replica_lag_steps",
                            "Steps a rank finished beyond the newest one its buddy node's agent holds; absent "
                            "for a rank whose replica no agent reported.", labels=["rank"])
    lost = GaugeMetricFamily("mindft_rank_lost_protection",
                             "1 when a rank's replica is behind the steps every rank keeps (LOST PROTECTION): "
                             "a loss of its node now could not be recovered.", labels=["rank"])
    slow = GaugeMetricFamily("mindft_rank_slow", "1 while a rank is flagged slow: its own work per step over its "
                                                 "peers' median beyond MINDFT_SLOW_THRESHOLD for MINDFT_SLOW_WINDOWS "
                                                 "windows in a row.", labels=["rank"])
    work = GaugeMetricFamily("mindft_rank_work_ratio", "A rank's own work per step (up to its collectives) over its "
                                                       "peers' median in the newest window; absent until measured.",
                             labels=["rank"])
    nodes = GaugeMetricFamily("mindft_world_nodes", "Nodes in the job's world now (an elastic job's changes "
                                                    "with its losses and returns).")
    world = GaugeMetricFamily("mindft_world_size", "Ranks in the job's world now.")
    limits = GaugeMetricFamily("mindft_world_nodes_limit", "An elastic job's MIN and MAX nodes (--nnodes MIN:MAX); "
                                                           "absent for a job that is not elastic.", labels=["limit"])
    resizes = CounterMetricFamily("mindft_world_resizes", "Changes of the job's world size so far.")
    goodput = GaugeMetricFamily("mindft_goodput_ratio", "The productive share of the job's wall time so far "
                                                        "(effective training time).")
    spent = CounterMetricFamily("mindft_job_seconds", "The job's wall time so far by where it went: productive "
                                                      "training or a badput bucket (mindft.flow.goodput).",
                                labels=["bucket"])
    if status is not None:
        if status.wall_seconds > 0:
            goodput.add_metric([], status.productive_seconds / status.wall_seconds)
        spent.add_metric(["productive"], status.productive_seconds)
        for bucket, seconds in zip(status.badput, status.badput_seconds):
            spent.add_metric([bucket], seconds)
        for candidate in JobState:
            state.add_metric([candidate.value], 1.0 if candidate is status.state else 0.0)
        step.add_metric([], status.step)
        if status.step_time >= 0:
            step_seconds.add_metric([], status.step_time)
        counts = dict.fromkeys(RankState, 0)
        for row in status.ranks:
            counts[row.state] += 1
            if row.replicated >= 0:
                lag.add_metric([str(row.rank)], max(0, row.step - row.replicated))
            lost.add_metric([str(row.rank)], 1.0 if row.replica_lost else 0.0)
            slow.add_metric([str(row.rank)], 1.0 if row.slow else 0.0)
            if row.work_ratio > 0:
                work.add_metric([str(row.rank)], row.work_ratio)
        for rank_state, count in counts.items():
            ranks.add_metric([rank_state.value], count)
        every.add_metric([], status.snapshot_every)
        if status.snapshot_cost >= 0:
            overhead.add_metric([], status.snapshot_cost)
        if status.overhead_budget > 0:
            budget.add_metric([], status.overhead_budget)
        over.add_metric([], 1.0 if status.over_budget else 0.0)
        world.add_metric([], status.world_size)
        if status.nodes:
            nodes.add_metric([], status.nodes)
        if status.max_nodes:
            limits.add_metric(["min"], status.min_nodes)
            limits.add_metric(["max"], status.max_nodes)
        resizes.add_metric([], status.resizes)
    yield from (state, step, step_seconds, ranks, every, overhead, budget, over, lag, lost, slow, work, goodput, spent,
                world, nodes, limits, resizes)


class JobMetrics:
    """The controller's metrics in a registry of their own (:attr:`registry`).

    :meth:`transition` is called by the controller for every :class:`Transition` it carries out;
    :meth:`watch` adds the job's status, read on each scrape.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.recoveries = Counter("mindft_recoveries", "Recoveries, by the kind of their first fault and the rung of "
                                  "the ladder that ended them (dying_gasp: the job failed).",
                                  ["kind", "rung"], registry=r)
        self.phase_seconds = Histogram("mindft_recovery_phase_seconds", "Seconds a completed recovery spent in "
                                       "each phase: detect (from the fault to the recovery's start), pause, repair "
                                       "(summed over its rounds, as rollback and resume), leave (from the order to "
                                       "leave a chip to the last exit; only when ranks were told to), rollback, "
                                       "resume.", ["phase"], buckets=SECONDS_BUCKETS, registry=r)
        self.recovery_seconds = Histogram("mindft_recovery_seconds", "Seconds from a fault to every rank resumed, "
                                          "per completed recovery.", buckets=SECONDS_BUCKETS, registry=r)
        self.lost_steps = Histogram("mindft_recovery_lost_steps", "Steps a completed recovery made the job train "
                                    "again: the newest step a rank finished minus the step every rank rolled back "
                                    "to.", buckets=STEPS_BUCKETS, registry=r)
        self.dying_gasps = Counter("mindft_dying_gasps", "Times the job failed and told every rank to write its "
                                   "dying-gasp checkpoint.", registry=r)
        for kind in FAULT_KINDS:  # every series exists from the start, so that rate() sees the first one
            for rung in RUNGS:
                self.recoveries.labels(kind, rung)
        for phase in (DETECT, *PHASES.values(), LEAVE):
            self.phase_seconds.labels(phase)
        self._kind: Optional[str] = None  # the current recovery's first fault (None: no recovery)
        self._rung = IN_PLACE
        self._newest = -1  # the newest step a rank finished since the recovery began

    def watch(self, status: Callable[[], StatusReply]) -> None:
        """Read the job's status on each scrape from ``status`` (thread-safe, e.g. ``Controller.latest_status``)."""
        self.registry.register(StatusCollector(status))

    def transition(self, job: Job, effect: Transition) -> None:
        """Count what the job's move says, from the job as it stands after the input that moved it."""
        if effect.target in RECOVERY_STATES:
            self._track(job)
        elif effect.target is JobState.NORMAL and effect.source is JobState.RESUMING:
            self._recovered(job)
        elif effect.target is JobState.FAILED:
            self.dying_gasps.inc()
            # A recovery gave up (also at once, as for a lost node no replica can replace): the
            # faults it was for are still the job's. A failure without one (an exception from
            # the script, a fault again in the same step) is counted by the dying gasp alone.
            kind = _first_fault(job) or self._kind
            if kind is not None:
                self.recoveries.labels(kind, DYING_GASP).inc()
            self._kind = None

    def _track(self, job: Job) -> None:
        """Remember the recovery's fault and rung as they stand now (every new fault moves the job:
        the last move before the recovery ends sees them all)."""
        self._kind = _first_fault(job) or self._kind or FaultKind.UNKNOWN.value
        self._rung = job.recovery.rung
        if job.state is not JobState.RESUMING:  # from RESUMING on, the ranks' progress starts at the rollback step
            self._newest = max(self._newest, job.ranks.fastest if len(job.ranks) else -1)

    def _recovered(self, job: Job) -> None:
        recovery = job.recovery
        self.recoveries.labels(self._kind or FaultKind.UNKNOWN.value, self._rung).inc()
        times = phase_times(job.history, recovery.started)
        self.phase_seconds.labels(DETECT).observe(recovery.detect_seconds())
        for state, phase in PHASES.items():
            self.phase_seconds.labels(phase).observe(times.get(state.value, 0.0))
        leave = recovery.leave_seconds()
        if leave is not None:  # a 0 would say ranks left at once, not that none was told to
            self.phase_seconds.labels(LEAVE).observe(leave)
        if job.recoveries:
            self.recovery_seconds.observe(job.recoveries[-1])
        if recovery.repair_step >= 0:
            self.lost_steps.observe(max(0, self._newest - recovery.repair_step))
        self._kind, self._rung, self._newest = None, IN_PLACE, -1


def _first_fault(job: Job) -> Optional[str]:
    """The kind of the current recovery's first fault of a rank (else the scheduler's; None: no fault)."""
    recovery = job.recovery
    first = next((fault for fault in recovery.faults.values() if not fault.collateral), None)
    if first is not None:
        return NODE_LOST if first.node >= 0 else first.kind.value
    return recovery.scheduler.kind.value if recovery.scheduler is not None else None


class NodeCollector(Collector):
    """What one node agent holds and did, read on each scrape (``mindft_node_*``, labelled ``node``).

    The agent's loop owns what is read here; the scrape, on the server's thread, only reads:
    the policy's per-rank counts (ints, atomic to read), the sizes of the snapshot files in the
    agent's shared memory (``state_dir``, set once the agent made it), and the replication's and
    the warm process's counters (their own locks, or ints). ``state_dir`` and ``replication``
    are attributes the agent sets when it has them (an assignment: atomic); absent parts give no
    series.
    """

    def __init__(self, node: int, policy: NodePolicy, warm: Optional[Any] = None) -> None:
        self.node = str(node)
        self.policy = policy
        self.warm = warm  # mindft.agent.warm.WarmStarter (None: MINDFT_WARM_START=0)
        self.state_dir: Optional[Path] = None  # the ranks' snapshots, on /dev/shm
        self.replication: Optional[Any] = None  # mindft.replica.NodeReplication (None: one node, or off)

    def describe(self) -> Iterable[Metric]:
        return list(_node_families(self.node))

    def collect(self) -> Iterable[Metric]:
        return list(_node_families(self.node, self))


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``; a file replaced while it is read (a capture's slot) counts as gone."""
    total = 0
    for item in path.rglob("*"):
        try:
            if item.is_file():
                total += item.stat().st_size
        except OSError:
            pass
    return total


def snapshot_sizes(state_dir: Path) -> dict[int, int]:
    """{rank: bytes of its snapshot files} in a node agent's ``state_dir`` (``rank<R>/``)."""
    sizes: dict[int, int] = {}
    for rank_dir in state_dir.glob("rank*"):
        suffix = rank_dir.name[len("rank"):]
        if suffix.isdigit() and rank_dir.is_dir():
            sizes[int(suffix)] = tree_bytes(rank_dir)
    return sizes


def _node_families(node: str, source: Optional[NodeCollector] = None) -> Iterator[Metric]:
    """The node's metric families (without samples when ``source`` is None: their description)."""
    def family(kind: type) -> Callable[..., Metric]:
        """A maker of ``kind`` families labelled by node, and by rank too where ``per_rank``."""
        def make(name: str, text: str, per_rank: bool = False) -> Metric:
            return kind(name, text, labels=["node", "rank"] if per_rank else ["node"])
        return make

    gauge, counter = family(GaugeMetricFamily), family(CounterMetricFamily)

    snapshot = gauge("mindft_node_snapshot_bytes", "Bytes of a local rank's snapshots (two slots) in the node "
                     "agent's shared memory.", per_rank=True)
    memory = gauge("mindft_node_shared_memory_bytes", "Bytes of shared memory the node agent holds: its ranks' "
                   "snapshots and the replicas it keeps.")
    restarts = counter("mindft_node_rank_restarts", "Processes of a local rank started after its first (every "
                       "restart, a hot reset's included).", per_rank=True)
    used = gauge("mindft_node_rank_restarts_used", "A local rank's exits a restart followed that count against "
                 "--max-restarts (a hot reset's do not).", per_rank=True)
    limit = gauge("mindft_node_max_restarts", "--max-restarts: the restarts each rank may use.")
    pushes = counter("mindft_node_replica_pushes", "Pushes of a local rank's snapshot to the next node's keeper.")
    sent = counter("mindft_node_replica_sent_bytes", "Bytes of snapshots handed to the network for the next "
                   "node's keeper (arrays it already had are not sent).")
    received = counter("mindft_node_replica_received_bytes", "Bytes of the previous node's replicas received "
                       "(of the replicas completed).")
    replicated = gauge("mindft_node_replicated_step", "The newest step of a local rank the next node's keeper "
                       "confirmed holding; absent until one.", per_rank=True)
    held = gauge("mindft_node_replica_held_step", "The step of the previous node's rank's replica this node's "
                 "keeper holds.", per_rank=True)
    held_bytes = gauge("mindft_node_replica_held_bytes", "Memory the replicas this node keeps take (arrays "
                       "shared with its own snapshots not counted).")
    cpu = counter("mindft_node_replication_cpu_seconds", "CPU seconds the node's replication threads (sender, "
                  "keeper, their ZeroMQ I/O threads) used; absent where Linux does not say.")
    warm = gauge("mindft_node_warm_start_available", "1 while workers are forked from the warm process, 0 once "
                 "it failed and they start cold; absent with MINDFT_WARM_START=0.")
    forks = counter("mindft_node_warm_forks", "Worker processes forked from the warm process.")
    pss = gauge("mindft_node_warm_pss_bytes", "The warm process's proportional set size (its share of the "
                "memory it maps); absent once it is gone.")
    if source is not None:
        policy = source.policy
        for rank, worker in sorted(policy.workers.items()):
            labels = [node, str(rank)]
            restarts.add_metric(labels, worker.restarts)
            used.add_metric(labels, worker.restarts_used)
        limit.add_metric([node], policy.max_restarts)
        state_dir = source.state_dir
        if state_dir is not None:
            sizes = snapshot_sizes(state_dir)
            for rank, size in sorted(sizes.items()):
                snapshot.add_metric([node, str(rank)], size)
            memory.add_metric([node], tree_bytes(state_dir))
        replication = source.replication
        if replication is not None:
            sender, keeper = replication.sender, replication.keeper
            pushes.add_metric([node], sender.pushes)
            sent.add_metric([node], sender.sent_bytes)
            received.add_metric([node], keeper.received_bytes)
            for rank, step in sorted(sender.replicated.items()):
                if step >= 0:
                    replicated.add_metric([node, str(rank)], step)
            for rank, step in sorted(keeper.held.items()):
                held.add_metric([node, str(rank)], step)
            held_bytes.add_metric([node], keeper.nbytes)
            seconds = replication.cpu.seconds()
            if seconds is not None:
                cpu.add_metric([node], seconds)
        starter = source.warm
        if starter is not None:
            warm.add_metric([node], 1.0 if starter.available else 0.0)
            forks.add_metric([node], starter.forked)
            size = proportional_set_size(starter.pid) if starter.available else None
            if size is not None:
                pss.add_metric([node], size)
    yield from (snapshot, memory, restarts, used, limit, pushes, sent, received, replicated, held, held_bytes, cpu,
                warm, forks, pss)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every few seconds is not news


def _metrics_only_app(registry: CollectorRegistry, elsewhere: str) -> Callable[..., Iterable[bytes]]:
    """``/metrics`` the exposition of ``registry``; every other path the line ``elsewhere``."""
    metrics = make_wsgi_app(registry)
    note = (elsewhere.rstrip("\n") + "\n").encode()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") == "/metrics":
            return metrics(environ, start_response)
        code = "200 OK" if environ.get("PATH_INFO", "/") in ("/", "/index.html") else "404 Not Found"
        start_response(code, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(note)))])
        return [note]
    return app


class MetricsServer:
    """``registry`` over HTTP at ``http://ADDRESS:PORT/metrics``, with the live status page at
    ``/`` (:mod:`mindft.observe.status_page`, reading the job's event log in ``run_dir``), in a daemon
    thread until :meth:`close`. Binds in the constructor: a port that cannot be bound (taken since
    the launcher's check) raises ConfigError (exit 2, as for the controller's port); the page shows
    the job once :meth:`show` names its status.

    A node without the controller has no status to show: given ``elsewhere`` (one line that
    says where the job's page is), it serves ``/metrics`` alone and answers that line on ``/``."""

    def __init__(self, registry: CollectorRegistry, address: str, port: int, run_dir: Optional[Path] = None,
                 elsewhere: Optional[str] = None) -> None:
        from mindft.observe.status_page import make_app

        self._status: Optional[Callable[[], Optional[Callable[[], StatusReply]]]] = None
        server_class = type("Server", (ThreadingWSGIServer,),
                            {"address_family": socket.AF_INET6 if ":" in address else socket.AF_INET})
        app = (make_app(registry, self._current_status, run_dir) if elsewhere is None
               else _metrics_only_app(registry, elsewhere))
        try:
            self._server = make_server(address, port, app, server_class, handler_class=_QuietHandler)
        except OSError as error:
            raise ConfigError(f"port {port} on {address}, the metrics port, cannot be bound ({error.strerror}); "
                              f"choose another --metrics-port") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="mindft-metrics", daemon=True)
        self._thread.start()
        self.address, self.port = address, port
        self._lock = threading.Lock()
        self._closed = False
        log.debug("metrics at %s", self.url)

    def show(self, status: Callable[[], StatusReply]) -> None:
        """The status page shows the job ``status`` returns (held weakly, as :class:`StatusCollector` does)."""
        self._status = weakref.WeakMethod(status) if inspect.ismethod(status) else lambda: status

    def _current_status(self) -> StatusReply:
        status = self._status() if self._status is not None else None
        if status is None:
            raise RuntimeError("the controller has not started, or has gone")
        return status()

    @property
    def url(self) -> str:
        """Where Prometheus scrapes."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.server_close()  # shutdown() alone keeps the port bound
        self._thread.join(5.0)
