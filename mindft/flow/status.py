"""What ``mindft status``, the status page and the metrics show of a job: one :class:`StatusReply`."""
from __future__ import annotations

import math
from typing import Any

from mindft.flow.goodput import BADPUT, PRODUCTIVE
from mindft.flow.states import RECOVERY_STATES
from mindft.protocol import RankStatus, StatusReply


def job_status(job: Any, now: float, request_id: int = 0) -> StatusReply:
    """A :class:`~mindft.flow.job.Job` at ``now``: its state and progress, every rank, the cadence, the
    command, the goodput."""
    rows = tuple(RankStatus(rank=r.rank, state=r.state, step=r.progress,
                            last_heartbeat_age=round(max(0.0, now - r.last_seen), 3), restarts=r.restarts,
                            pid=r.pid, incarnation=r.incarnation, replica_endpoint=r.replica_endpoint,
                            order=job.ladder.order(r.rank), replicated=job.replicas.step(r.rank),
                            replica_lost=r.rank in job.replicas.unprotected,
                            work_ratio=round(job.slow.ratios.get(r.rank, 0.0), 3), slow=r.rank in job.slow.flagged)
                 for r in sorted(job.ranks, key=lambda r: r.rank))
    if job.result is not None:
        reason = job.result.reason
    else:
        reason = job.recovery.summary() if job.state in RECOVERY_STATES else ""
    tuner = job.tuner
    seconds = job.goodput.at(now)
    return StatusReply(state=job.state, step=job.ranks.slowest, ranks=rows, reason=reason,
                       round=job.recovery.round, recoveries=len(job.recoveries), request_id=request_id,
                       restart_all=job.restart_all, snapshot_every=tuner.every, snapshot_cost=round(tuner.cost(), 6),
                       step_time=round(tuner.step_time(), 6),
                       overhead_budget=tuner.budget.overhead if tuner.budget is not None else 0.0,
                       over_budget=tuner.over_budget, waiting=job.ladder.waiting_for(),
                       deadline_in=round(max(0.0, job.deadline - now), 3) if job.deadline < math.inf else -1.0,
                       term=job.term, standbys=job.standby_addresses(),
                       spares=len(job.spares.live_spares(now)), standing_by=job.standing_by,
                       wall_seconds=round(sum(seconds.values()), 3),
                       productive_seconds=round(seconds[PRODUCTIVE], 3), badput=BADPUT,
                       badput_seconds=tuple(round(seconds[name], 3) for name in BADPUT),
                       world_size=job.ranks.world_size, nodes=job.ranks.world_size // job.nproc if job.nproc else 0,
                       min_nodes=job.elastic.min_nodes if job.elastic else 0,
                       max_nodes=job.elastic.max_nodes if job.elastic else 0, resizes=len(job.resizes))
