"""The simulated job of tests/sim.py, elastic (``SimJob(..., elastic=(MIN, MAX), shrink_after=...)``).

:class:`ElasticWorld` plays what a job started with ``mindft-launch --nnodes MIN:MAX`` goes through
(:mod:`mindft.flow.elastic`), as the real shells do it:

- every node agent, and every warm spare, says hello to the controller every ``HELLO_INTERVAL``
  (that is how the job tells a lost node from a quiet one);
- on a :class:`~mindft.flow.effects.Resize` the simulator carries on with
  :func:`~mindft.flow.elastic.successor` at once, as the controller's shell does; each node agent
  carries out its :class:`~mindft.protocol.WorldResize` a moment later, as ``RoleChanges._resize`` /
  ``_join`` do: it stops its ranks (their memory stays), renumbers them and their memory, and says
  hello as its new node in the new term; a spare told ``join`` becomes the next node;
- the new world's rank processes start on the new job's orders from their agents' memory, a joining
  rank from a copy of the peer's snapshot the order names;
- a launcher started again for a node (:meth:`~sim.SimJob.lose_node_at` with a finite
  ``replace_after``) replaces it while the node is lost in the present world; else the job answers
  it :class:`~mindft.protocol.Replaced` (the node was left behind, renumbered, or given to a spare)
  and it waits as a spare; :meth:`spare_at` starts a spare; a spare the job gives a lost node
  (:class:`~mindft.flow.effects.GiveNode`) replaces it.

Its invariants, besides tests/sim.py's: a shrink leaves behind only nodes that are really gone and
keeps at least MIN; a growth stays within MAX; an agent stops its ranks at a growth only once its
memory holds the boundary step, and the new world, if nothing failed since, rolls back to no step
before it (no step trained is lost by growing); the final world holds MIN..MAX nodes and every rank
of it ends with the state of a fault-free run; a job FAILED with a node lost for good only when the
nodes left are fewer than MIN.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from mindft.exitcodes import ExitCode
from mindft.flow import JobState, Transition
from mindft.flow.agent import NodePolicy
from mindft.flow.effects import Finish, GiveNode, Resize
from mindft.flow.elastic import new_node, successor
from mindft.flow.spares import HELLO_INTERVAL
from mindft.protocol import AgentHello, JobView, NodeLost, Replaced, WorldResize
from sim import MAX_RESTARTS, SimRank, Violation

if TYPE_CHECKING:
    from sim import SimJob

AGENT_DELAY = (0.01, 0.3)  # s before a node agent carries out a WorldResize (the message, stopping its ranks)


class ElasticWorld:
    """The elastic part of one :class:`~sim.SimJob` (see the module docstring)."""

    def __init__(self, sim: SimJob) -> None:
        self.sim = sim
        self.resizes = 0  # worlds the job went through before the present one
        self.resizing = False  # from a resize until the new world trains (or the job ends)
        self.terms: dict[bytes, int] = {}  # an agent's link -> the newest term it knows (a resize's)
        self.spares: list[bytes] = []  # warm spares waiting, their links
        # An agent yet to carry out a resize -> the node it was and its processes.
        self.pending: dict[bytes, tuple[int, list[SimRank]]] = {}
        self.hello_at = 0.0
        self.links = 0  # agents started so far beside the first ones: each has its own link
        self.growth: Optional[tuple[int, int]] = None  # (boundary step, faults injected then) of a growth
        self.grown_at_faults = -1  # faults injected when the job last grew
        self.shrinks = self.growths = 0
        self.spare_delay: Optional[float] = None  # spare_after_shrink's

    # ---- the schedule ----
    def spare_at(self, seconds: float) -> None:
        """A warm spare starts at ``seconds`` (simulated)."""
        self.sim.timers.append((seconds, "spare", None))

    def spare_after_shrink(self, seconds: float) -> None:
        """A warm spare starts ``seconds`` after the job first shrinks (the node back, say)."""
        self.spare_delay = seconds

    def known_term(self, node: int) -> int:
        return self.terms.get(self.sim.peer_of(node), 0)

    def _new_link(self, what: str) -> bytes:
        self.links += 1
        return f"agent.{what}.{self.links}".encode()

    # ---- hooks of SimJob ----
    def tick(self) -> None:
        """Every agent and spare says hello every HELLO_INTERVAL, as on its link."""
        sim = self.sim
        if sim.now - self.hello_at < HELLO_INTERVAL or sim.job.result is not None:
            return
        self.hello_at = sim.now
        # A real agent starts a process at once (the simulator takes 0.2 s): no hello comes in between.
        starting = {sim.node_of(payload[0].rank) for _, kind, payload in sim.timers if kind == "restart"}
        for node in sorted(sim.agents):
            link = sim.peer_of(node)
            if node in sim.lost_nodes or node in starting:
                continue
            if link in self.pending:
                self._stale_hello(link)
            else:
                sim._apply(sim.job.handle(link, sim.hello(node), sim.now))
        for peer in list(self.spares):
            sim._apply(sim.job.handle(peer, AgentHello(-1, (), spare=True), sim.now))

    def timer(self, kind: str, payload: object) -> bool:
        """Carry out a timer of this module's (True), or leave it to the simulator (False)."""
        sim = self.sim
        if kind == "spare":
            self._spare(self._new_link("spare"))
        elif kind == "stale hello":
            self._stale_hello(payload)
        elif kind == "resize":
            peer, order = payload
            self._carry_out(peer, order)
        elif kind == "replace" and not sim.controller_lost and payload not in sim.lost_nodes:
            self._launcher_back(payload)
        elif kind == "replace" and not sim.controller_lost and payload:
            sim.peers[payload] = self._new_link(f"node{payload}")  # a new agent: its own link, no term known
            return False
        else:
            return False
        return True

    def told(self, peers: tuple[bytes, ...], message: object) -> None:
        """A message for agents: a WorldResize is carried out a moment later; Replaced makes a spare."""
        sim = self.sim
        for peer in peers:
            if isinstance(message, Replaced):
                if sim.node_at(peer) >= 0:
                    raise Violation(f"the job told node {sim.node_at(peer)}'s live agent it was replaced: "
                                    f"{message.reason}")
                self._spare(peer)
            elif sim.node_at(peer) >= 0 or peer in self.spares:
                delay = sim.random.uniform(*AGENT_DELAY)
                sim.timers.append((sim.now + delay, "resize", (peer, message)))
                if sim.random.random() < 0.3:  # a hello it says before the order reaches it
                    sim.timers.append((sim.now + delay / 2, "stale hello", peer))

    def effect(self, effect: object) -> None:
        if isinstance(effect, Resize):
            self._resize(effect)
        elif isinstance(effect, GiveNode):
            self._adopt(effect)

    def moved(self, effect: Transition) -> None:
        sim = self.sim
        if effect.target is JobState.ROLLBACK and self.growth is not None:
            step, injected = self.growth
            self.growth = None
            repair = sim.job.recovery.repair_step
            if injected == self._faults() and repair < step:
                raise Violation(f"the job grew after step {step} but the new world rolled back to step {repair}: "
                                f"a step trained was lost")
        if effect.target in (JobState.NORMAL, JobState.DONE, JobState.FAILED):
            self.resizing = False

    def copy(self, number: int, keeper: str, peer: int) -> None:
        """A joining rank's agent fetches a copy of data-parallel peer ``peer``'s newest snapshot from
        the keeper of the peer's node, which serves it from that node's memory."""
        sim = self.sim
        node = sim.node_of(peer)
        if keeper != f"keeper{node}" or peer >= sim.world_size:
            raise Violation(f"rank {number} told to copy rank {peer}'s state from {keeper}, not node {node}'s keeper")
        held = {} if node in sim.lost_nodes else sim.ranks[peer].snapshots
        step = max(held, default=-1)
        sim.ranks[number].snapshots = {} if step < 0 else {step: held[step]}

    def check_end(self, result: Finish) -> bool:
        """The elastic end checks; True when the end is accounted for (no further check applies)."""
        sim = self.sim
        least, most = sim.elastic
        if not least <= sim.nodes <= most and result.exit_code == ExitCode.OK:
            raise Violation(f"the job ended on {sim.nodes} nodes, outside {least}:{most}")
        if result.exit_code != ExitCode.OK and self.grown_at_faults == self._faults():
            raise Violation(f"the job FAILED after it grew, with no fault since: {result.reason}")
        if result.exit_code == ExitCode.OK or not sim.lost_nodes:
            return False
        if sim.nodes - len(sim.lost_nodes) >= least:
            return False  # it could have gone on without them: tests/sim.py's checks apply
        for rank in sim.ranks.values():  # below MIN: the old behaviour, the dying gasps
            if rank.mode not in ("exited", "dead"):
                raise Violation(f"job FAILED but rank {rank.rank} is still {rank.mode}")
        return True

    # ---- the world changes ----
    def _resize(self, resize: Resize) -> None:
        """The controller's shell carries on with the job of the new world; the agents follow."""
        sim = self.sim
        least, most = sim.elastic
        nproc = sim.world_size // sim.nodes
        if resize.lost and (len(resize.members) < least or any(n not in sim.lost_nodes for n in resize.lost)):
            raise Violation(f"shrank to nodes {resize.members} leaving {resize.lost} behind (lost: "
                            f"{sorted(sim.lost_nodes)}, MIN {least})")
        if resize.joins and resize.nnodes > most:
            raise Violation(f"grew to {resize.nnodes} nodes, over MAX {most}")
        if resize.lost and self.spare_delay is not None:
            self.spare_at(sim.now + self.spare_delay)
            self.spare_delay = None
        self.shrinks += bool(resize.lost)
        self.growths += bool(resize.joins)
        if resize.joins:
            self.growth = (sim.job.ranks.slowest, self._faults())
            self.grown_at_faults = self._faults()
        self.resizes += 1
        old_ranks, old_agents = sim.ranks, sim.agents
        links = {node: sim.peer_of(node) for node in old_agents}
        ranks: dict[int, SimRank] = {}
        sim.agents, sim.peers = {}, {}
        for index, node in enumerate((*resize.members, *(-1 for _ in resize.joins))):
            link = links[node] if node >= 0 else resize.joins[index - len(resize.members)]
            sim.peers[index] = link
            if node >= 0:
                sim.agents[index] = old_agents[node]
                self.pending[link] = (node, [old_ranks[node * nproc + local] for local in range(nproc)])
            else:
                sim.agents[index] = NodePolicy((), MAX_RESTARTS, spare=True)
                self.pending[link] = (-1, [])
                self.spares.remove(link)
            for local in range(nproc):
                old = old_ranks[node * nproc + local] if node >= 0 else None
                ranks[index * nproc + local] = SimRank(sim, index * nproc + local, old.incarnation if old else 0,
                                                       old.snapshots if old else {}, process=False)
        sim.lost_nodes = {new_node(resize.members, node) for node in sim.lost_nodes if node in resize.members}
        sim.ranks, sim.world_size, sim.nodes = ranks, resize.world_size, resize.nnodes
        # Processes a node agent was starting are stopped with the others; the ring of replicas starts anew.
        sim.timers = [t for t in sim.timers if t[1] not in ("restart", "device")]
        sim.resetting.clear()
        for state in (sim.keeper, sim.unsent, sim.confirmed, sim.pushes, sim.behind_since):
            state.clear()
        sim.job = successor(sim.job, sim.now)
        sim.last_round, sim.recovery_started, self.resizing = 0, None, True

    def _carry_out(self, peer: bytes, order: WorldResize) -> None:
        """A node agent carries out a WorldResize (``RoleChanges._resize`` / ``_join``)."""
        sim = self.sim
        node = sim.node_at(peer)
        _, stopping = self.pending.pop(peer, (-1, None))
        if node < 0 or stopping is None or node in sim.lost_nodes:
            return  # gone with its node, or an order of a world before
        policy = sim.agents[node]
        for process in stopping:
            if order.step >= 0 and max(process.snapshots, default=-1) < order.step:
                raise Violation(f"node {node}'s agent stops rank {process.rank} at a growth's boundary, step "
                                f"{order.step}, which its memory does not hold ({sorted(process.snapshots)})")
            if process.alive:
                process.mode = "dead"
            if process.rank in policy.workers:
                policy.stopped(process.rank, -9)
        self.terms[peer] = max(self.terms.get(peer, 0), order.term)
        sim._carry_out(node, policy.resize(sim.node_ranks(node), f"node {node} of {sim.nodes} now: {order.reason}"))
        if sim.job.result is None:
            sim._apply(sim.job.handle(peer, sim.hello(node), sim.now))

    def _stale_hello(self, link: bytes) -> None:
        """An agent not told of the resize yet says hello as the node it was."""
        sim = self.sim
        if link in self.pending and sim.job.result is None:
            was, processes = self.pending[link]
            hello = AgentHello(was, tuple(p.rank for p in processes), term=self.terms.get(link, 0))
            sim._apply(sim.job.handle(link, hello, sim.now))

    def _spare(self, peer: bytes) -> None:
        if peer not in self.spares:
            self.spares.append(peer)
            self.terms.pop(peer, None)  # as a spare it learns the job anew
            if self.sim.job.result is None and not self.sim.controller_lost:
                self.sim._apply(self.sim.job.handle(peer, AgentHello(-1, (), spare=True), self.sim.now))

    def _adopt(self, given: GiveNode) -> None:
        """A spare given lost node ``given.node`` becomes its agent (``RoleChanges._adopt``)."""
        sim = self.sim
        if given.node not in sim.lost_nodes:
            raise Violation(f"node {given.node}, whose agent is alive, was given to a spare")
        self.spares.remove(given.spare)
        sim.peers[given.node] = given.spare
        if sim.job.state is JobState.STARTING:
            # A controller rebuilding the job: the spare holds nothing of the node, and says so.
            sim.lost_nodes.discard(given.node)
            ranks = sim.node_ranks(given.node)
            for number in ranks:
                sim.ranks[number] = SimRank(sim, number, 0, {}, process=False)
            policy = sim.agents[given.node] = NodePolicy(ranks, MAX_RESTARTS, runs_controller=given.node == 0)
            status = sim.job.status(sim.now)
            policy.on_view(JobView(status.state, status.restart_all, reason=status.reason))
            sim._carry_out(given.node, policy.rejoin({}))
            sim._apply(sim.job.handle(given.spare, sim.hello(given.node), sim.now))
        else:
            sim._replace_node(given.node, adoption=given.adoption)

    def _launcher_back(self, node: int) -> None:
        """The launcher of node ``node`` (its number when started) is back, and the node it was is not
        lost in the present world: the job answers its report of the node lost Replaced."""
        sim = self.sim
        if sim.job.result is not None:
            return
        if sim.job.state is JobState.STARTING:
            # It finds the new world being rebuilt: it would start its ranks as for a job that starts (a
            # case the flow does not sort out yet), so here it waits until the job trains.
            sim.timers.append((sim.now + HELLO_INTERVAL, "replace", node))
            return
        link = self._new_link(f"node{node}")
        nproc = sim.world_size // sim.nodes
        ranks = tuple(range(node * nproc, (node + 1) * nproc))
        answer = [e.message for e in sim.job.handle(link, NodeLost(node, ranks, (-1,) * nproc, (), "back"), sim.now)
                  if getattr(e, "peer", None) == link]
        if not any(isinstance(message, Replaced) for message in answer):
            raise Violation(f"the launcher of node {node}, which the job no longer has lost, was not told it was "
                            f"replaced: {answer}")
        self._spare(link)

    def _faults(self) -> int:
        """Faults so far (a growth's rollback may go further back after one)."""
        sim = self.sim
        return len(sim.injected) + sum(sim.node_epoch.values()) + sim.schedulers_lost + sum(sim.phase_hits.values())
