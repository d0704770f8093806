"""Elastic data parallelism: a job started with ``mindft-launch --nnodes MIN:MAX`` goes on with fewer
nodes when one is lost for good.

A node is lost when its agent and every one of its ranks fell silent (:mod:`mindft.flow.spares`);
it is lost *for good* once it stayed so for ``shrink_after`` more seconds, with no spare given it
and no launcher of its own back. With at least MIN nodes left the job shrinks to them: the
controller tells every node agent the new membership (:class:`~mindft.protocol.WorldResize`: the
nodes that stay, in their order, numbered 0..N-1 from now on) and rebuilds the job in the next
term of command, as a standby that takes command does (:mod:`mindft.flow.rejoin`): every worker
restarts from its agent's memory into a new MindSpore cluster of the smaller world, and every
rank rolls back to the newest snapshot all of them hold. In data parallelism each surviving rank
holds the whole replicated state (weights, optimizer state, step, RNG); where each rank's data
comes from is the step's (:mod:`mindft.rank.data`), not the rank's. With fewer than MIN nodes left
nothing changes: the job waits for the node up to ``timeouts.repair`` and ends with its dying gasps.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from mindft.config import MindftConfig
from mindft.flow.effects import Broadcast, Resize, Send
from mindft.flow.states import JobState
from mindft.protocol import WorldResize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElasticRange:
    """MIN:MAX nodes, and how long a lost node is waited for before the job goes on without it."""

    min_nodes: int
    max_nodes: int
    shrink_after: float

    def shrink(self, nnodes: int, lost: Sequence[int]) -> Optional[tuple[int, ...]]:
        """The nodes that stay (their present numbers, in order) when ``lost`` of ``nnodes`` are gone
        for good; None when none is lost or fewer than MIN would stay."""
        members = tuple(node for node in range(nnodes) if node not in set(lost))
        if len(members) == nnodes or len(members) < self.min_nodes:
            return None
        return members


def elastic_of(config: MindftConfig) -> Optional[ElasticRange]:
    """The job's range (MINDFT_ELASTIC), or None when it is not elastic."""
    if not config.elastic_min:
        return None
    return ElasticRange(config.elastic_min, config.elastic_max, config.shrink_after)


# The parallel modes whose ranks each hold the whole replicated state (MindSpore's names).
WHOLE_STATE_MODES = ("data_parallel", "stand_alone")


def parallel_refusal(config: MindftConfig, parallel_mode: str, shards_optimizer: bool) -> str:
    """Why a rank that trains in ``parallel_mode`` (sharding its optimizer state or not) cannot be in
    an elastic job ("": it can, or the job is not elastic): a lost node must take nothing with it that
    no other rank holds, which only data parallelism without a sharded optimizer guarantees."""
    if not config.elastic_min:
        return ""
    asked = f"an elastic job (MINDFT_ELASTIC={config.elastic_min}:{config.elastic_max})"
    if parallel_mode not in WHOLE_STATE_MODES:
        return (f"{asked} needs data parallelism, where every rank holds the whole state; parallel_mode is "
                f"{parallel_mode}")
    if shards_optimizer:
        return (f"{asked} cannot shard the optimizer state (enable_parallel_optimizer): a lost node's shard would "
                f"be gone; turn it off or drop --nnodes MIN:MAX")
    return ""


def new_node(members: Sequence[int], node: int) -> int:
    """``node``'s number in the world of ``members`` (-1: not a member)."""
    return members.index(node) if node in members else -1


def shrink_reason(nnodes: int, members: Sequence[int], lost: Sequence[int], waited: float, min_nodes: int) -> str:
    """Why the job shrinks, in the words the logs and the event log use."""
    gone = ", ".join(map(str, lost))
    stay = ", ".join(f"{node}→{index}" for index, node in enumerate(members) if node != index)
    return (f"node {gone} lost for good (no spare and no launcher of its own within {waited:g} s): the job goes on "
            f"with {len(members)} of {nnodes} nodes (MIN {min_nodes})" + (f", renumbered {stay}" if stay else ""))


def left_behind(job: Any, peer: bytes, node: int, now: float) -> str:
    """Why the agent at ``peer``, speaking for ``node``, has no node in the job's world ("": it has
    one): a node beyond the world (one the job left behind, its launcher started again), or, once
    the job was resized, a number another live agent holds now (the nodes were renumbered). It is
    answered :class:`~mindft.protocol.Replaced` and waits as a spare."""
    if job.elastic is None or node < 0 or not job.nproc:
        return ""
    nnodes = job.ranks.world_size // job.nproc
    if node >= nnodes:
        return (f"the job runs on {nnodes} node(s) now (elastic {job.elastic.min_nodes}:{job.elastic.max_nodes}): "
                f"node {node} was left behind; this agent waits as a spare")
    seen = job.spares.nodes.get(node)
    if job.resizes and seen is not None and seen.peer != peer and now - seen.last_seen <= job.spares.silent_after:
        return (f"node {node} is another agent's since the job was resized (term {job.term}); this agent waits "
                f"as a spare")
    return ""


def resize_when_due(job: Any, now: float) -> None:
    """The job's world changes when a node is lost for good (:func:`shrink_when_lost`) or a spare can
    take it back towards MAX (:func:`grow_when_spare`)."""
    shrink_when_lost(job, now)
    grow_when_spare(job, now)


def grow_when_spare(job: Any, now: float) -> None:
    """While the job trains on fewer than MAX nodes: a live spare joins at the next snapshot boundary
    (the slowest rank finished a step every rank snapshots: no step trained is lost), once this world
    trained past the step the previous one had reached (no resize right after another). It becomes the
    next node; every worker restarts into the larger world, the spare's ranks from a data-parallel
    peer's state (:meth:`~mindft.flow.rejoin.Survivors.copy`). One spare per resize."""
    rules, nproc = job.elastic, job.nproc
    if rules is None or job.resized is not None or job.state is not JobState.NORMAL or not nproc:
        return
    nnodes, step = job.ranks.world_size // nproc, job.ranks.slowest
    spares = job.spares.live_spares(now)
    if nnodes >= rules.max_nodes or not spares or step <= job.trained_before or \
            job.tuner.schedule.at_or_before(step) != step:
        return
    members = tuple(range(nnodes))
    reason = (f"a spare joins as node {nnodes}: the job grows to {nnodes + 1} of {rules.max_nodes} nodes (MAX) after "
              f"step {step}, every rank's snapshot")
    resize = Resize(members, nproc, job.term + 1, (), reason, joins=(spares[0],))
    _resize(job, resize, step)


def shrink_when_lost(job: Any, now: float) -> None:
    """While ``job`` (the :class:`~mindft.flow.job.Job` that calls this) trains or recovers: the nodes
    lost for good (``shrink_after`` past their loss, :mod:`mindft.flow.spares`) are left behind when at
    least MIN nodes stay (:class:`Resize`); below MIN the job goes on waiting, said once."""
    rules, nproc = job.elastic, job.nproc
    if rules is None or job.resized is not None or job.standing_by or not nproc or job.state in (
            JobState.DONE, JobState.FAILED):
        return
    nnodes = job.ranks.world_size // nproc
    if job.state is JobState.STARTING:
        # A controller that rebuilds the job (a standby in command, or one started again) waits for
        # every node's agent: the nodes none speaks for within shrink_after are lost for good.
        if not job.survivors.under_way or now - job.history[0][1] < rules.shrink_after:
            return
        lost = sorted({rank // nproc for rank in job.survivors.unheard()})
    else:
        heard = {record.rank: record.last_seen for record in job.ranks}
        lost = job.spares.lost_nodes(now - rules.shrink_after, heard)
    members = rules.shrink(nnodes, lost)
    if members is None:
        if lost and job.below_min != tuple(lost):
            job.below_min = tuple(lost)
            log.warning("node %s lost for good, but the job would keep %d node(s), fewer than MIN %d: it waits for "
                        "the node (timeouts.repair), then ends with its dying gasps", ", ".join(map(str, lost)),
                        nnodes - len(lost), rules.min_nodes)
        return
    reason = shrink_reason(nnodes, members, lost, rules.shrink_after + job.spares.silent_after, rules.min_nodes)
    _resize(job, Resize(members, nproc, job.term + 1, tuple(lost), reason))


def _resize(job: Any, resize: Resize, step: int = -1) -> None:
    """Tell every node agent of the job the new world (each spare that joins, the node it becomes;
    ``step``: the boundary their memory must hold before they stop their ranks), then the shell: this
    job commands nothing more, its :func:`successor` does."""
    told = WorldResize(resize.term, resize.members, resize.nproc, resize.reason, nodes=resize.nnodes, step=step)
    job.emit(Broadcast(tuple(dict.fromkeys(job.agents.values())), told))
    for number, spare in enumerate(resize.joins, start=len(resize.members)):
        job.emit(Send(spare, replace(told, join=number)))
    job.emit(resize)
    job.resized = resize


def successor(job: Any, now: float) -> Any:
    """The job of the world ``job.resized`` describes, in its term: it rebuilds the job from what the
    node agents say they hold once every one of them said hello as its new node (:mod:`mindft.flow.rejoin`).
    What measures the job as a whole goes on: its goodput, its recoveries' count, the cadence's rules."""
    resize = job.resized
    if resize is None:
        raise ValueError("the job was not resized")
    new = type(job)(resize.world_size, job.timeouts, now, snapshot_every=job.snapshot_every,
                    restart_scope=job.restart_scope, budget=job.tuner.budget, term=resize.term,
                    candidates=tuple(new_node(resize.members, node) for node in job.candidates
                                     if node in resize.members),
                    supersedes=job.supersedes, slow=job.slow.policy, elastic=job.elastic)
    new.nproc, new.restart_all, new.goodput = resize.nproc, job.restart_all, job.goodput
    if job.elastic is not None:
        new.goodput.resized(resize.nnodes / job.elastic.max_nodes, now)
    new.rebuild_reason, new.min_hello_term = resize.reason, resize.term
    new.resized_links = frozenset((*job.agents.values(), *resize.joins))
    new.survivors.joining = len(resize.members) * resize.nproc
    new.trained_before = job.ranks.slowest
    new.ladder.recoveries.extend(job.ladder.recoveries)
    new.resizes = (*job.resizes, resize)
    return new
