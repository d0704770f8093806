"""The node agent: runs one node of a job (its ranks' processes, MindSpore's scheduler and, on node
0, the controller and the reset-file watcher) and carries out what :mod:`mindft.flow.agent`
decides. ``mindft-launch`` (:mod:`mindft.cli.launch`) builds it from the command line.

Orders travel one way: the job addresses each kill or start (:class:`~mindft.protocol.RankOrder`)
and its view (:class:`~mindft.protocol.JobView`) to the agent that runs the rank, in-process on
node 0 (:meth:`Controller.attach_agent`), over a link of its own (:class:`~mindft.agent.links.ControllerLink`)
elsewhere. Everything the agent learns goes through one queue to the supervise loop, which
feeds the policy and carries out its effects; nothing here decides.

What it runs beside its ranks is :mod:`mindft.agent.services`'; the node's memory, from its
start to its dying gasps and its removal, :mod:`mindft.agent.memory`'s; the start of an agent
that replaces a lost node, :mod:`mindft.agent.takeover`'s; its changes of role (a standby that
takes over, a spare that adopts a node, a node that becomes a spare), :mod:`mindft.agent.roles`'.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import signal
import time
from typing import Any, Optional

from mindft.net.channel import Client
from mindft.snapshot.ckpt import atomic_write
from mindft.config import TFT_VARIABLE
from mindft.observe.events import EventLog, ProcessExitRecord, node_file
from mindft.exitcodes import ExitCode, describe_exit
from mindft.agent.links import ControllerHost, ControllerLink, recovery_progress
from mindft.agent.relay import RelayShell
from mindft.agent.memory import (agent_memory, dump_ranks_without_process, release_memory, remove_stale_memory,
                                 start_replication, write_node_gasp)
from mindft.agent.services import host_controller, serve_node_metrics, start_mindio, start_warm
from mindft.agent.roles import RoleChanges
from mindft.agent.takeover import restore_replica
from mindft.flow.agent import (AbortJob, AgentEffect, BecomeSpare, Ending, KillWorker, NodePolicy, Say,
                               StartWorker)
from mindft.flow.inputs import SchedulerLost
from mindft.flow.spares import HELLO_INTERVAL
from mindft.flow.standby import Failover, takeover_after
from mindft.flow.states import RECOVERY_STATES
from mindft.net.keys import load_keys
from mindft.agent.plan import JOB_FILE, LaunchSpec, mindio_gate_address
from mindft.config import load_config
from mindft.observe.units import size_text
from mindft.net.address import node_ip, port_listening
from mindft.protocol import (AdoptNode, AgentHello, JobView, Message, ProcessExit, RankOrder, Replaced, Reply,
                             WorldResize)
from mindft.snapshot.store import newest_step
from mindft.agent.workers import Console, Scheduler, WorkerProcesses

log = logging.getLogger(__name__)

MONITOR_INTERVAL = 0.1
SCHEDULER_EXIT_GRACE = 30.0     # after this node's ranks finished, for the scheduler to finish on its own
SCHEDULER_PORT_WAIT = 10.0      # for the scheduler's port to be free before a new scheduler binds it


def unprotected_notice(tft_value: str) -> str:
    """The one line that says a job runs without fault tolerance and how to turn it on."""
    why = (f"{TFT_VARIABLE}={tft_value!r} enables no option" if tft_value.strip()
           else f"{TFT_VARIABLE} is not set")
    return (f"fault tolerance is OFF ({why}): the ranks train unprotected, with no controller and no "
            f"restarts; turn it on with e.g. {TFT_VARIABLE}='{{RSC:1}}'")


class NodeAgent(RoleChanges):
    """Run one node of a job to completion and return its exit code."""

    def __init__(self, spec: LaunchSpec, console: Optional[Console] = None) -> None:
        self.spec = spec
        self.console = console or Console(prefix=spec.prefix_output)
        self.warm = start_warm(spec)
        # This node's event log: its processes' starts and exits (the controller keeps the job's).
        self.events = EventLog(spec.run_dir / node_file(spec.node_rank), f"node {spec.node_rank}")
        self.workers = WorkerProcesses(spec, self.console, self.warm, self.events)
        self.keys = None if spec.insecure or not spec.protected else load_keys(spec.key_file)
        self.client = Client(spec.controller_address, self.keys)
        self.policy = NodePolicy(tuple(spec.local_ranks), spec.max_restarts, protected=spec.protected,
                                 reports=spec.protected and not spec.mindio,
                                 runs_controller=spec.protected and not spec.mindio and spec.node_rank == 0,
                                 spare=spec.spare)
        self.runner: Optional[ControllerHost] = None
        # This node's own metrics (mindft.observe.metrics.NodeCollector), served with the controller's on
        # node 0 and by a server of its own (metrics_server) on the other nodes.
        self.node_metrics: Optional[Any] = None
        self.metrics_server: Optional[Any] = None
        if spec.metrics_port is not None and spec.protected and not spec.mindio:
            from mindft.observe.metrics import NodeCollector

            self.node_metrics = NodeCollector(spec.node_rank, self.policy, self.warm)
        self.link: Optional[ControllerLink] = None
        self.mindio_host: Optional[Any] = None
        self.replication: Optional[Any] = None  # mindft.replica.NodeReplication
        self.relay: Optional[RelayShell] = None  # its ranks' control traffic goes through it
        self.scheduler: Optional[Scheduler] = Scheduler(spec, self.warm, self.events) if spec.runs_scheduler else None
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()  # orders and views, from any thread
        self._signal: Optional[int] = None
        self._signals_seen = 0
        self._announced = ""  # the failure already told to people
        self._schedulers = 0  # MindSpore schedulers replaced by a new one
        self._phase_since = self._progress_last = 0.0  # when the job's current phase began; the last progress line
        self._from_memory: list[int] = []  # ranks whose dying gasp this agent wrote from its memory
        # With standbys: the controllers this agent follows, and how long one may be silent.
        self.failover: Optional[Failover] = None
        timeouts = load_config(spec.env).timeouts
        self._takeover_after = takeover_after(timeouts.dead_after, timeouts.connect_retries)
        self._dead_after = timeouts.dead_after
        self._resolve_at = 0.0  # when the controller's name (--master-addr) may be resolved again
        self.term = 0  # the newest term of command this agent knows without standbys (a resize's)

    # ---- carrying out the policy's effects ------------------------------------------------------

    def _carry_out(self, effects: list[AgentEffect]) -> None:
        for effect in effects:
            if isinstance(effect, Say):
                self.console.line("mindft-launch", effect.text)
            elif isinstance(effect, StartWorker):
                if effect.renew_cluster:
                    self._renew_cluster()
                if effect.restore_from:
                    restore_replica(self.spec, self.keys, effect.rank, effect.restore_from, self._say,
                                    effect.restore_rank)
                self.console.line("mindft-launch", effect.reason)
                self.policy.started(effect.rank, self.workers.start(effect.rank, effect.restarts))
                self.write_job_file()
            elif isinstance(effect, KillWorker):
                self.workers.signal_workers([effect.rank], signal.SIGKILL)
            elif isinstance(effect, (ProcessExit, SchedulerLost)):
                self._report(effect)
            elif isinstance(effect, AbortJob):
                self._announced = effect.reason
                self.console.line("mindft-launch", f"job failed: {effect.reason}")
            elif isinstance(effect, BecomeSpare):
                self._become_spare(effect.controller)

    def _report(self, message: ProcessExit | SchedulerLost) -> None:
        if self.runner is not None:
            self.runner.controller.from_local_agent(message)
        elif self.link is not None and isinstance(message, ProcessExit):
            self.link.send(message)
        else:  # the scheduler runs on node 0 only, in the controller's process
            log.error("nobody to tell of %s: no controller in this process", message)

    def _renew_cluster(self) -> None:
        """Before the first worker of a restart of every worker: a new MindSpore scheduler, as the
        workers that come back cannot join the old cluster (MCCL on CPU), nor a dead scheduler's.
        The old one's log is kept as ``scheduler.N.log`` (N: its number, from 0), so the new one's
        log (what its exit is judged by) is its own."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        if scheduler.pid is None:  # this node's first (its standby controller took over)
            scheduler.start()
            self.console.line("mindft-launch", f"MindSpore's scheduler (pid {scheduler.pid}) moved to this node: "
                                               f"{scheduler.address}, for the workers that start again")
            return
        scheduler.exit_seen = True  # stopping it is no failure
        scheduler.stop(0.0, 0.0)
        self._schedulers += 1
        kept = scheduler.log_path.with_name(f"{scheduler.log_path.stem}.{self._schedulers - 1}.log")
        try:
            scheduler.log_path.replace(kept)
        except OSError as error:
            log.warning("cannot keep the old scheduler's log as %s: %s", kept, error)
        # Its listening socket closed with it (MindSpore binds with SO_REUSEADDR, so the old
        # connections' TIME_WAIT does not hold the port); wait for a process that still holds it.
        deadline = time.monotonic() + SCHEDULER_PORT_WAIT
        while port_listening(self.spec.scheduler_port) and time.monotonic() < deadline:
            time.sleep(MONITOR_INTERVAL)
        scheduler.exit_seen = False
        scheduler.start()
        self.console.line("mindft-launch", f"a new MindSpore scheduler (pid {scheduler.pid}) on {scheduler.address} "
                                           f"for the workers that start again; the previous one's log: {kept}")

    @property
    def known_term(self) -> int:
        """The newest term of command this agent knows: it refuses what an older one says."""
        return max(self.term, self.failover.term if self.failover is not None else 0)

    def _on_message(self, message: Message, now: float) -> None:
        if isinstance(message, (JobView, RankOrder, AdoptNode, WorldResize)) and message.term < self.known_term:
            self._say(f"refused a {type(message).__name__} of term {message.term}: this node follows the controller "
                      f"of term {self.known_term}")
            return
        if isinstance(message, JobView):  # sent on every transition of the job, and in answer to each hello
            if self.failover is not None:
                self.failover.view(message)
            if self.policy.view is None or message.state is not self.policy.view.state:
                self._phase_since = self._progress_last = now
            self.policy.on_view(message)
        elif isinstance(message, RankOrder):
            self._carry_out(self.policy.on_order(message))
        elif isinstance(message, AdoptNode):
            self._adopt(message)
        elif isinstance(message, WorldResize):
            self._resize(message)
        elif isinstance(message, Replaced):
            self._carry_out(self.policy.replaced(message.reason, message.controller))
        elif isinstance(message, Reply) and not message.ok:
            log.warning("controller: %s", message.detail)

    # ---- running ----------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals_seen += 1
        if self._signal is None:
            self._signal = signum
        if self._signals_seen > 1:  # a second Ctrl-C: do not wait for the grace period
            self.workers.signal_workers(self.workers.workers, signal.SIGKILL)

    def write_job_file(self) -> None:
        """``run_dir/job.json``: what ``mindft status --job`` and the demo need to find the job."""
        spec = self.spec
        info = {"controller": spec.controller_address, "key_file": None if spec.insecure else str(spec.key_file),
                "insecure": spec.insecure, "reset_file": spec.env.get("MINDFT_RESET_FILE", ""),
                "world_size": spec.world_size, "node_rank": spec.node_rank,
                "scheduler": self.scheduler.address if self.scheduler is not None else None,
                "scheduler_pid": self.scheduler.pid if self.scheduler is not None else None,
                "launcher_pid": os.getpid(), "log_dir": str(spec.log_dir),
                "ranks": {str(r): pid for r, pid in self.workers.pids().items()}}
        atomic_write(spec.run_dir / JOB_FILE, lambda handle: handle.write(json.dumps(info, indent=2).encode()))

    def run(self) -> int:
        """Start everything, supervise until the job ends, stop everything; the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        spec = self.spec
        if not spec.protected:
            self.console.line("mindft-launch", unprotected_notice(spec.env.get(TFT_VARIABLE, "")))
        elif spec.mindio:
            self.mindio_host = start_mindio(spec, self.keys, self.policy, self.inbox.put)
        elif spec.node_rank == 0:
            self.runner = host_controller(spec, self.node_metrics, self.inbox.put)
            if spec.controller_port == 0:
                # The controller picked a free port; every rank and client must use it.
                spec = self.spec = self.workers.spec = dataclasses.replace(spec, controller_port=self.runner.port)
                self.client = Client(spec.controller_address, self.keys)
        if self.node_metrics is not None and self.runner is None:
            self.metrics_server = serve_node_metrics(spec, self.node_metrics)
        elif spec.metrics_port is not None and self.runner is None:
            why = "MindIO TFT coordinates this job" if spec.mindio else "fault tolerance is off"
            log.warning("--metrics-port: no metrics are served: only mindft's node agents serve them (%s)", why)
        self.console.line("mindft-launch", self._banner())
        code: Optional[int] = None
        try:
            if spec.protected:
                stale = remove_stale_memory()
                if stale:
                    what = "directory" if len(stale) == 1 else "directories"
                    self._say(f"removed {len(stale)} memory {what} of launchers on this host that are gone "
                              f"({size_text(sum(size for _, size in stale))}): "
                              f"{', '.join(str(path) for path, _ in stale)}")
                spec = self.spec = self.workers.spec = dataclasses.replace(spec, state_dir=agent_memory())
                log.info("the ranks' snapshots live in %s (shared memory held for the job)", spec.state_dir)
                self.replication = start_replication(spec, self.keys)
                if self.node_metrics is not None:
                    self.node_metrics.state_dir, self.node_metrics.replication = spec.state_dir, self.replication
                if self.replication is not None:
                    spec = self.spec = self.workers.spec = dataclasses.replace(
                        spec, replica_endpoint=self.replication.endpoint)
                if not spec.mindio:
                    self.relay = RelayShell(spec.node_rank, spec.controller_address, self.keys,
                                            load_config(spec.env).timeouts, spec.state_dir)
                    spec = self.spec = self.workers.spec = dataclasses.replace(spec, relay_endpoint=self.relay.endpoint)
            if self.scheduler is not None:
                self.scheduler.start()  # first, as msrun: workers connect to it from init()
            if not spec.spare and not self._take_over_lost_node():
                for rank in spec.local_ranks:
                    self.policy.started(rank, self.workers.start(rank, 0))
            if spec.protected and not spec.mindio and self.runner is None:
                self.link = ControllerLink(spec, self.keys)
                if spec.standbys:
                    standby = (f"tcp://{node_ip(spec.master_ip)}:{spec.controller_port}"
                               if 1 <= spec.node_rank <= spec.standbys else "")
                    self.failover = Failover(standby)
            self.write_job_file()
            code = self._supervise()
        finally:
            self._stop_everything(code)
        return code

    def _banner(self) -> str:
        spec = self.spec
        controller = (f"controller {spec.controller_address}{' (INSECURE)' if spec.insecure else ''}"
                      if spec.protected else "no controller")
        if spec.mindio:
            controller = (f"MindIO TFT controller {spec.master_ip}:{spec.controller_port} (its TCP is not "
                          f"encrypted), step gate {mindio_gate_address(spec)}")
        if spec.scheduler_port is None:
            cluster = "no MindSpore scheduler"
        else:
            host = f"[{spec.master_ip}]" if ":" in spec.master_ip else spec.master_ip
            cluster = f"MindSpore scheduler {host}:{spec.scheduler_port}"
        server = self.runner.metrics_server if self.runner is not None else self.metrics_server
        metrics = f"; metrics {server.url}" if server is not None else ""
        return (f"{spec.world_size} rank(s), {spec.nproc} on this node (node {spec.node_rank}/{spec.nnodes}); "
                f"{controller}; {cluster}{metrics}; run directory {spec.run_dir}, logs in {spec.log_dir}")

    def _supervise(self) -> int:
        while True:
            now = time.monotonic()
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                self.console.line("mindft-launch", f"{name}: stopping every rank (grace period "
                                                   f"{self.spec.grace_period:g}s, then SIGKILL)")
                self.policy.interrupted = True
                self.workers.kill_worker(self.workers.running(), self._signal, self.spec.grace_period)
                return 128 + self._signal
            # The controller's verdict before its messages: every view it sent before finishing
            # is in the inbox by then, so the ending below sees the job as the controller left it.
            controller = self._controller_code()
            self._say_hello(now)
            self._take_inputs(now)
            for rank, code in self.workers.exits().items():
                self._carry_out(self.policy.on_exit(rank, code))
            self._check_scheduler()
            self._check_controller_side(now)
            self._check_controller_name(now)
            self._check_failover(now)
            if self.link is not None:
                self._carry_out(self.policy.controller_silent(self.link.silent_for(now), self.link.silence_limit))
            ending = self.policy.ending(now, controller)
            if ending is not None:
                return self._end(ending)
            time.sleep(MONITOR_INTERVAL)

    def _say_hello(self, now: float) -> None:
        """Tell the controller what this agent runs and holds (from that, a controller started again
        rebuilds the job: :mod:`mindft.flow.rejoin`) when the policy says a hello is due."""
        if self.runner is None and self.link is None:
            return
        if not self.policy.hello_due(now, in_process=self.runner is not None, interval=HELLO_INTERVAL):
            return
        spec, workers = self.spec, self.policy.workers
        ranks = tuple(spec.local_ranks)
        kept = self.replication.keeper.held if self.replication is not None else {}
        hello = AgentHello(spec.node_rank, ranks, pids=tuple(workers[r].pid or 0 for r in ranks),
                           incarnations=tuple(workers[r].restarts for r in ranks),
                           newest=tuple(newest_step(spec.state_dir / f"rank{r}") if spec.state_dir else -1
                                        for r in ranks),
                           keeper=self.replication.endpoint if self.replication is not None else "",
                           kept=tuple(kept), kept_steps=tuple(kept.values()), spare=self.policy.spare,
                           address=self.failover.address if self.failover is not None else "",
                           term=self.known_term)
        if self.runner is not None:
            self.runner.controller.from_local_agent(hello)
        else:
            self.link.send(hello)

    def _take_inputs(self, now: float) -> None:
        if self.link is not None:
            for message in self.link.receive(now):
                self._on_message(message, now)
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._on_message(message, now)

    def _controller_code(self) -> Optional[int]:
        result = self.runner.poll() if self.runner is not None else None
        return None if result is None else result.exit_code

    def _check_controller_side(self, now: float) -> None:
        """Node 0: the watcher and the progress lines. MindIO: the host's watcher and stand-in."""
        if self.runner is not None:
            view = self.policy.view
            self.runner.start_watcher_when_training(view.state if view is not None else None)
            failure = self.runner.check_watcher(now)
            if failure is not None:
                self._carry_out(self.policy.abort(failure))
            elif self.runner.poll() is None:
                self._report_progress(now)
        if self.mindio_host is not None:
            failure = self.mindio_host.check(now)
            if failure is not None:
                self._carry_out(self.policy.abort(failure))
            standin = self.mindio_host.standin
            if standin is not None and standin.failed is not None:
                self.policy.no_more_starts()  # ranks off their chip come back only on 'recovered'

    def _check_scheduler(self) -> None:
        scheduler = self.scheduler
        if scheduler is None or scheduler.exit_seen:
            return
        code = scheduler.poll()
        if code is None:
            scheduler.cluster_formed()  # when the cluster formed is a phase of a restart: the event log says it
        else:
            scheduler.exit_seen = True
            self.events.append(ProcessExitRecord("scheduler", scheduler.pid or 0, code))
            self._carry_out(self.policy.on_scheduler_exit(scheduler.pid, code, scheduler.last_error(),
                                                             str(scheduler.log_path), scheduler.cluster_formed()))

    def _report_progress(self, now: float) -> None:
        """While a recovery waits, say so at a steady pace (the controller logs only transitions);
        the controller's status is asked for only when a line is due."""
        view = self.policy.view
        if view is None or view.state not in RECOVERY_STATES:
            return
        if now - self._progress_last < self.spec.progress_interval:
            return
        self._progress_last = now
        line = recovery_progress(self.runner.status(), now - self._phase_since)
        if line is not None:
            self.console.line("mindft-launch", line)

    def _end(self, ending: Ending) -> int:
        if ending.reason and ending.reason != self._announced:
            self.console.line("mindft-launch", f"job failed: {ending.reason}" if self.policy.failure is not None
                              else f"{ending.reason}; stopping")
        if ending.stop_running:
            self.workers.kill_worker(self.workers.running(), signal.SIGTERM, self.spec.grace_period)
            for rank, code in self.workers.exits().items():
                self.policy.stopped(rank, code)
        result = self.runner.poll() if self.runner is not None else None
        step = self.policy.dump_step(result.dump_step if result is not None else None)
        self._from_memory += dump_ranks_without_process(self.spec, self.policy, step, self._say)
        if self.policy.writes_dying_gasp:
            write_node_gasp(self.spec, self.policy, self.replication, self.keys, step,
                            self.policy.failure_reason(result.reason if result is not None else ""),
                            self._from_memory, self._say)
        return self.policy.exit_code(ending)

    def _say(self, text: str) -> None:
        self.console.line("mindft-launch", text)

    def _stop_everything(self, code: Optional[int]) -> None:
        running = self.workers.running()
        if running:
            self.workers.kill_worker(running, signal.SIGTERM, self.spec.grace_period)
        if self.scheduler is not None:
            self._stop_scheduler(clean_end=code == ExitCode.OK)
        if self.relay is not None:
            self.relay.close()
        if self.runner is not None:
            self.runner.stop()
        if self.link is not None:
            self.link.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.mindio_host is not None:
            self.mindio_host.stop()  # after the ranks (after a clean end the controller is gone already)
        for worker in self.workers.workers.values():
            if worker.pump is not None:
                worker.pump.join(2.0)
        if self.warm is not None:
            self.console.line("mindft-launch", self.warm.summary())
            self.warm.close()
        release_memory(self.spec, self.replication, self._say)
        self.events.close()

    def _stop_scheduler(self, clean_end: bool) -> None:
        """Stop the scheduler; after a clean end first let it see every worker unregister (ranks on
        other nodes may still be unregistering, as under msrun, which waits for its scheduler). A
        scheduler no worker ever joined (a script that never calls init()) is stopped at once."""

        scheduler = self.scheduler
        wait = SCHEDULER_EXIT_GRACE if clean_end and scheduler.cluster_formed() else 0.0
        code = scheduler.stop(wait, self.spec.grace_period)
        if wait and code != ExitCode.OK and not scheduler.exit_seen:
            log.warning("MindSpore's scheduler (pid %d) %s after the job ended; see %s", scheduler.pid,
                        describe_exit(code) if code is not None else "did not stop", scheduler.log_path)
