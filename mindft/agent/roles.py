"""How a node agent changes role during a job: it follows a standby controller, or starts its own
node's (:mod:`mindft.flow.standby`), follows its controller's name to a new host, replaces a lost
node (a launcher started again for it, or a spare the controller gave it to), and becomes a spare
when its node was given away or its controller stood down (:mod:`mindft.flow.spares`).

:class:`RoleChanges` is the part of :class:`mindft.agent.shell.NodeAgent` that carries these out;
what to do is :class:`~mindft.flow.agent.NodePolicy`'s, :class:`~mindft.flow.standby.Failover`'s
and the controller's to say.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Any, Optional

from mindft.agent.links import ControllerHost, ControllerLink
from mindft.agent.memory import start_replication
from mindft.agent.plan import LaunchSpec
from mindft.agent.services import host_controller
from mindft.agent.takeover import take_over_lost_node
from mindft.agent.workers import Scheduler, WorkerProcesses
from mindft.flow.agent import AgentEffect, NodePolicy
from mindft.flow.standby import Failover, Move
from mindft.net.address import host_address
from mindft.net.channel import Client, endpoint_host
from mindft.observe.events import ControllerFollowed, EventLog
from mindft.observe.units import size_text
from mindft.flow.elastic import new_node
from mindft.protocol import AdoptNode, Replaced, WorldResize
from mindft.snapshot.store import newest_step

log = logging.getLogger(__name__)

GROW_HOLD_WAIT = 10.0  # s: for this node's memory to hold a growth's boundary step before its ranks stop


class RoleChanges:
    """A node agent's changes of role (see the module docstring); mixed into the node agent, whose
    state it changes."""

    spec: LaunchSpec
    policy: NodePolicy
    workers: WorkerProcesses
    events: EventLog
    keys: Any
    client: Client
    link: Optional[ControllerLink]
    runner: Optional[ControllerHost]
    scheduler: Optional[Scheduler]
    replication: Optional[Any]
    relay: Optional[Any]
    failover: Optional[Failover]
    node_metrics: Optional[Any]
    metrics_server: Optional[Any]
    warm: Optional[Any]
    inbox: Any
    _takeover_after: float
    _dead_after: float
    _resolve_at: float
    term: int

    def _say(self, text: str) -> None:
        raise NotImplementedError

    def _carry_out(self, effects: list[AgentEffect]) -> None:
        raise NotImplementedError

    def write_job_file(self) -> None:
        raise NotImplementedError

    # ---- standby controllers --------------------------------------------------------------------

    def _check_failover(self, now: float) -> None:
        """Once the job trained, a controller silent for ``takeover_after`` is followed by the next
        candidate (:class:`~mindft.flow.standby.Failover`); with none left, the ranks give up on it
        as without standbys."""
        failover, link = self.failover, self.link
        if failover is None or link is None or not self.policy.under_way or self.policy.job_over:
            return
        silent = link.silent_for(now)
        if silent <= self._takeover_after:
            return
        move = failover.silent()
        if move is not None:
            self._follow(move, silent)

    def _follow(self, move: Move, silent: float) -> None:
        """Move this agent's link to the next controller candidate; on the candidate's own node, start
        its controller there (standing by, :mod:`mindft.flow.standby`), and MindSpore's scheduler
        with the workers' next start."""
        self._say(f"the controller at {self.spec.controller_address} said nothing for {silent:.1f} s "
                  f"(> {self._takeover_after:g} s): following the standby at {move.address} (term {move.term})")
        host = endpoint_host(move.address)
        replaced = self.spec.controller_address
        self.events.append(ControllerFollowed(replaced, move.address, move.term, round(silent, 3), move.here))
        if not move.here:
            self._relink(host, -1)
            return
        self.link.close()
        self.link = None
        self.spec = dataclasses.replace(self.spec, master_ip=host, controller_node=self.spec.node_rank)
        self.workers.assign(self.spec)
        if self.metrics_server is not None:  # the controller serves them from now on, with the status page
            self.metrics_server.close()
            self.metrics_server = None
        self.runner = host_controller(self.spec, self.node_metrics, self.inbox.put, standby_term=move.term,
                                      supersedes=replaced)
        self.policy.runs_controller = True
        if self.spec.scheduler_port is not None:
            self.scheduler = Scheduler(self.spec, self.warm, self.events)
            self.policy.scheduler_moved()
        self._say(f"this node's standby controller listens on {self.spec.controller_address} (term {move.term}); "
                  f"it takes command once half of the node agents follow it")
        self._following()

    def _check_controller_name(self, now: float) -> None:
        """A controller given by name (``--master-addr``, a pod's) is looked up again after each
        period of ``dead_after`` it is silent: a pod rescheduled onto another host keeps its name."""
        spec, link = self.spec, self.link
        if link is None or spec.controller_node != 0 or not spec.master_addr or spec.master_addr == spec.master_ip:
            return
        if now < self._resolve_at or link.silent_for(now) <= self._dead_after:
            return
        self._resolve_at = now + self._dead_after
        ip = host_address(spec.master_addr)
        if ip is not None and ip != spec.master_ip:
            self._say(f"{spec.master_addr} now resolves to {ip} (was {spec.master_ip}): the controller moved there")
            self._relink(ip, 0)

    def _relink(self, host: str, controller_node: int) -> None:
        """The job's controller (and MindSpore's scheduler) is on ``host`` now: link there, and start the
        workers with that address from now on."""
        if self.link is not None:
            self.link.close()
        self.spec = dataclasses.replace(self.spec, master_ip=host, controller_node=controller_node)
        self.workers.assign(self.spec)
        self.link = ControllerLink(self.spec, self.keys)
        self._following()

    def _following(self) -> None:
        self.client = Client(self.spec.controller_address, self.keys)
        if self.replication is not None:
            self.replication.follow(self.spec.controller_address)
        if self.relay is not None:
            self.relay.follow(self.spec.controller_address)
        self.policy.hello_again()
        self.write_job_file()

    # ---- a node that replaces a lost one, spares ------------------------------------------------

    def _take_over_lost_node(self, adoption: int = 0) -> bool:
        """On a node other than 0: when the job already runs with this node's ranks (this agent
        replaces a lost node, started again without its memory, or a spare the node was given to
        by ``adoption``), restore their replicas, report the lost node (:mod:`mindft.agent.takeover`)
        and start them as the policy says. False (nothing done) for a starting job. A node given
        to a spare already makes this agent a spare."""
        if not self.policy.may_replace_lost_node:
            return False
        taken = take_over_lost_node(self.spec, self.keys, self.client, self.replication is not None, self._say,
                                    adoption)
        if taken is None:
            return False
        if isinstance(taken, Replaced):
            self._carry_out(self.policy.replaced(taken.reason))
            return True
        self.policy.on_view(taken.view)
        self._carry_out(self.policy.rejoin(taken.incarnations))
        return True

    def _adopt(self, order: AdoptNode) -> None:
        """The controller gives this spare lost node ``order.node``: it becomes that node's agent and
        takes over its ranks from their replicas on the next node."""
        if not self.policy.spare:
            log.warning("the controller gave node %d to this agent, which runs node %d: ignored", order.node,
                        self.spec.node_rank)
            return
        self._say(f"this spare becomes node {order.node} (adoption {order.adoption}): {order.reason}")
        spec = dataclasses.replace(self.spec, node_rank=order.node, spare=False)
        self.policy.adopt(spec.local_ranks)
        self._run_node(spec)
        if self.policy.rebuilding:
            # A controller that took over rebuilds the job: it restarts every worker, this node's
            # from the replicas it names, once this agent said it holds nothing of them.
            self._carry_out(self.policy.rejoin({}))
            self.policy.hello_again()
        elif not self._take_over_lost_node(order.adoption):
            self._carry_out(self.policy.abort(f"node {order.node} was given to this spare, but the job no longer "
                                              f"runs its ranks"))
        self.write_job_file()

    # ---- elastic data parallelism ---------------------------------------------------------------

    def _resize(self, order: WorldResize) -> None:
        """The job goes on with ``order.members`` (:mod:`mindft.flow.elastic`): stop this node's ranks,
        renumber the node, its ranks and their memory (each rank's snapshots in ``state_dir/rank<R>``
        move to its new number), replicate anew along the new ring, and say hello as the new node; the
        controller starts every worker from here. A node left out of the world waits as a spare."""
        self.term = max(self.term, order.term)
        if self.failover is not None:
            self.failover.term, self.failover.moved = max(self.failover.term, order.term), 0
        if order.join >= 0:
            self._join(order)
            return
        if order.step >= 0:
            self._hold_step(order.step)
        self._stop_ranks()
        node = new_node(order.members, self.spec.node_rank)
        if node < 0:
            self._become_spare("")
            return
        old = self.spec
        spec = dataclasses.replace(old, nproc=order.nproc, nnodes=order.nodes or len(order.members), node_rank=node,
                                   controller_node=new_node(order.members, old.controller_node))
        if spec.state_dir is not None:
            moves = list(zip(old.local_ranks, spec.local_ranks))
            for before, after in sorted(moves, reverse=node > old.node_rank):
                if before != after and (spec.state_dir / f"rank{before}").exists():
                    (spec.state_dir / f"rank{before}").rename(spec.state_dir / f"rank{after}")
        if self.replication is not None:
            freed = self.replication.discard()
            if freed:
                self._say(f"dropped the replicas of the previous ring ({size_text(freed)}): the new ring replicates "
                          f"anew")
        self._run_node(spec)
        if self.scheduler is not None:
            self.scheduler.spec = self.spec
        self._carry_out(self.policy.resize(spec.local_ranks, f"node {old.node_rank} is node {node} of "
                                                               f"{spec.nnodes} now: {order.reason}"))
        self.write_job_file()

    def _hold_step(self, step: int) -> None:
        """A growth's snapshot boundary: wait (a few seconds at most) until this node's memory holds
        ``step`` of every local rank, so that stopping the ranks loses no step they trained."""
        deadline = time.monotonic() + GROW_HOLD_WAIT
        dirs = [self.spec.state_dir / f"rank{rank}" for rank in self.spec.local_ranks] if self.spec.state_dir else []
        while any(newest_step(d) < step for d in dirs) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _join(self, order: WorldResize) -> None:
        """The job grows by this spare (:mod:`mindft.flow.elastic`): it becomes node ``order.join`` of
        ``order.nodes``; its ranks start with every worker, each from a data-parallel peer's state the
        controller names."""
        if not self.policy.spare:
            log.warning("the controller made node %d of this agent, which runs node %d: ignored", order.join,
                        self.spec.node_rank)
            return
        spec = dataclasses.replace(self.spec, node_rank=order.join, nnodes=order.nodes, nproc=order.nproc, spare=False)
        self._run_node(spec)
        self._carry_out(self.policy.resize(spec.local_ranks, f"this spare becomes node {order.join} of "
                                                             f"{order.nodes}: {order.reason}"))
        self.write_job_file()

    def _run_node(self, spec: LaunchSpec) -> None:
        """This agent runs ``spec``'s node from now on: the node's replication (along its ring), its
        workers, its metrics."""
        self.replication = start_replication(spec, self.keys)
        if self.replication is not None:
            spec = dataclasses.replace(spec, replica_endpoint=self.replication.endpoint)
        self.spec = spec
        self.workers.assign(spec)
        if self.node_metrics is not None:
            self.node_metrics.node, self.node_metrics.replication = str(spec.node_rank), self.replication

    def _stop_ranks(self) -> None:
        """Kill what still runs of this node's ranks, and tell the policy they stopped as told."""
        running = self.workers.running()
        if running:
            self.workers.kill_worker(running, signal.SIGKILL, self.spec.grace_period)
            for rank, code in self.workers.exits().items():
                self.policy.stopped(rank, code)

    def _become_spare(self, controller: str) -> None:
        """This agent's node was given to another agent, or the controller it ran stood down for the
        one at ``controller``: stop what still runs of the node (its ranks, its controller, MindSpore's
        scheduler, its replication), and wait as a spare of the job's controller."""
        self._stop_ranks()
        if self.runner is not None:
            self.runner.stop()
            self.runner = None
        if self.scheduler is not None:
            self.scheduler.exit_seen = True  # stopping it is no failure
            self.scheduler.stop(0.0, self.spec.grace_period)
            self.scheduler = None
        if self.replication is not None:
            self.replication.close()
            self.replication = None
        self.spec = dataclasses.replace(self.spec, node_rank=-1, spare=True, replica_endpoint=None)
        if self.failover is None and self.spec.standbys:
            self.failover = Failover("")
        self.policy.spare_again()
        self._relink(endpoint_host(controller) if controller else self.spec.master_ip,
                     -1 if controller else self.spec.controller_node)
        self._say(f"this agent is a warm spare now, of the controller at {self.spec.controller_address}: it takes a "
                  f"lost node's ranks when the controller says")
