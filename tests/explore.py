"""The seeded explorer: random jobs, random fault schedules, random interleavings."""
from __future__ import annotations

import math
import random

from mindft.flow.cadence import Budget
from mindft.protocol import FaultKind
from sim import PHASES, RESIZING, SimJob

KINDS = (FaultKind.UCE, FaultKind.COMMUNICATION, FaultKind.UNKNOWN)
SEEDS = 10_000  # the fast tier explores the first thousand, the slow tier the rest


def random_job(seed: int) -> SimJob:
    """One schedule: world size, steps, cadence (fixed, or chosen by the job within a budget:
    then longer, so it changes), up to three faults, and for some even world sizes two nodes
    whose agents replicate (fast, slow or lossy) and one of which may be lost (node 0 with the
    controller), also in the middle of a recovery, and for some jobs with collectives the loss of
    MindSpore's scheduler, all from ``seed``; some jobs are elastic instead (:func:`elastic_job`)."""
    pick = random.Random(seed)
    world, steps = pick.randint(2, 4), pick.randint(3, 9)
    budget = Budget(max_replay=pick.choice((2, 3, 4, 6))) if pick.random() < 0.4 else None
    if budget is not None:
        steps *= 2
    job = SimJob(world, steps, seed=seed, snapshot_every=pick.choice((1, 1, 2, 3)), collectives=pick.random() < 0.5,
                 budget=budget)
    for _ in range(pick.choice((0, 1, 1, 2, 3))):
        rank, step = pick.randrange(world), pick.randint(1, steps)
        what = pick.random()
        if what < 0.45:
            job.fail_at(rank, step, pick.choice(KINDS))
        elif what < 0.7:
            job.kill_at(rank, step, incarnation=pick.choice((0, 0, 1)))
        else:
            job.device_reset_at(rank, step, seconds=pick.uniform(0.1, 3.0), fails=pick.random() < 0.15)
    # Drawn last, so the schedules above stay what they were for every seed.
    if world % 2 == 0 and pick.random() < 0.35:
        job.spread(2, replica_speed=pick.choice((0, 1, 1, 3)), replica_drop=pick.choice((0.0, 0.0, 0.3)))
        if pick.random() < 0.6:
            job.lose_node_at(pick.randrange(2), pick.randint(1, steps), replace_after=pick.uniform(0.5, 8.0))
    if job.collectives and pick.random() < 0.25:
        job.lose_scheduler_at(pick.randint(1, steps))
    if job.faults or job.kills or job.device_resets:  # a fault in the middle of a recovery
        for _ in range(pick.choice((0, 1, 1, 2))):
            job.fault_in_phase(pick.choice(PHASES), pick.randrange(world), pick.choice(("device", "device", "kill")),
                               seconds=pick.uniform(0.1, 3.0))
        if job.nodes > 1 and pick.random() < 0.3:  # a node lost in the middle of a recovery (node 0: the controller)
            job.fault_in_phase(pick.choice(PHASES), pick.randrange(world), "node", seconds=pick.uniform(0.5, 6.0))
    job.standby = pick.random() < 0.5  # drawn last: who rebuilds the job when node 0 is lost
    if pick.random() < 0.15:  # drawn after all the above, which it replaces: an elastic job
        return elastic_job(seed, pick)
    job.relays = pick.random() < 0.5  # drawn last: the node agents relay their ranks' traffic
    return job


def elastic_job(seed: int, pick: random.Random) -> SimJob:
    """An elastic job of 3 or 4 nodes (MIN 1, 2, or all of them: nothing shrinks) that loses a node
    other than 0 for good, or until its launcher is back; maybe a spare later; rank faults; and,
    while a resize is under way, a rank killed or a second node lost (for good, or for a while)."""
    nodes, nproc = pick.choice((3, 3, 4)), pick.choice((1, 1, 2))
    steps = pick.randint(15, 40)
    job = SimJob(nodes * nproc, steps, seed=seed, snapshot_every=pick.choice((1, 1, 2)),
                 collectives=pick.random() < 0.5, elastic=(pick.choice((1, 2, 2, nodes)), nodes),
                 shrink_after=pick.uniform(1.0, 8.0)).spread(nodes, replica_speed=pick.choice((1, 3, 3)))
    job.lose_node_at(pick.randrange(1, nodes), pick.randint(1, steps // 2),
                     replace_after=pick.choice((math.inf, math.inf, pick.uniform(0.5, 25.0))))
    spare = pick.random()
    if spare < 0.5:  # the node back, as a spare, soon after the job shrank: it grows again
        job.world.spare_after_shrink(pick.uniform(0.0, 1.5))
    elif spare < 0.7:  # a spare at any moment: it may take the lost node before the job shrinks
        job.world.spare_at(pick.uniform(1.0, 18.0))
    for _ in range(pick.choice((0, 0, 1, 2))):
        rank, step = pick.randrange(job.world_size), pick.randint(1, steps)
        if pick.random() < 0.5:
            job.fail_at(rank, step, pick.choice(KINDS))
        else:
            job.kill_at(rank, step, incarnation=pick.choice((0, 1, 2)))
    if pick.random() < 0.4:
        job.fault_in_phase(RESIZING, pick.randrange(job.world_size), "kill")
    if pick.random() < 0.3:  # a second node lost while the job resizes (never node 0's ranks)
        job.fault_in_phase(RESIZING, pick.randrange(nproc, job.world_size), "node",
                           seconds=pick.choice((math.inf, pick.uniform(0.5, 20.0))))
    return job


def explore(seeds: range) -> dict[str, int]:
    """Run every seed and check its end; returns how the jobs ended. Raises on a violation,
    naming the seed so it can be replayed with ``random_job(seed).run()``."""
    ends = {"done": 0, "failed": 0, "nodes lost": 0, "controllers lost": 0, "standbys in command": 0,
            "schedulers lost": 0, "shrinks": 0, "growths": 0, "relayed": 0, "relayed faults in a phase": 0,
            "relayed nodes lost": 0, "relayed standbys in command": 0, **dict.fromkeys((*PHASES, RESIZING), 0)}
    for seed in seeds:
        job = random_job(seed)
        try:
            job.run()
            job.check_end()
        except AssertionError as error:
            raise AssertionError(f"seed {seed}: {error}") from error
        ends["done" if job.outcome.exit_code == 0 else "failed"] += 1
        ends["nodes lost"] += job.node_lost
        ends["controllers lost"] += job.controllers > 1
        ends["standbys in command"] += job.controllers > 1 and job.standby
        ends["schedulers lost"] += job.schedulers_lost > 0
        if job.world is not None:
            ends["shrinks"] += job.world.shrinks > 0
            ends["growths"] += job.world.growths > 0
        for phase, hits in job.phase_hits.items():
            ends[phase] += hits
        if job.relays:  # a rank faulting while its relay holds its node's acks; a relay lost mid-phase
            ends["relayed"] += 1
            ends["relayed faults in a phase"] += any(job.phase_hits[phase] for phase in PHASES)
            ends["relayed nodes lost"] += job.node_lost
            ends["relayed standbys in command"] += job.controllers > 1 and job.standby
    return ends


def check_explored(seeds: range) -> None:
    """Explore ``seeds`` and check that the schedules reached every kind of end and of fault."""
    ends = explore(seeds)
    assert ends["done"] + ends["failed"] == len(seeds)
    assert ends["done"] > len(seeds) * 0.8  # most schedules are recoverable ones
    assert ends["failed"] > 0               # and the failing ones are explored too
    assert ends["nodes lost"] > len(seeds) * 0.05  # and lost nodes, recovered or not
    assert ends["controllers lost"] > len(seeds) * 0.02  # node 0 with the controller among them
    assert ends["standbys in command"] > len(seeds) * 0.01  # rebuilt by a standby in some
    assert ends["schedulers lost"] > len(seeds) * 0.05  # and MindSpore's scheduler lost mid-training
    assert all(ends[phase] > len(seeds) * 0.01 for phase in PHASES), ends  # and faults in every phase of an episode
    assert ends["shrinks"] > len(seeds) * 0.04 and ends["growths"] > len(seeds) * 0.015, ends  # elastic jobs resize
    assert ends["relayed"] > len(seeds) * 0.3, ends  # node agents relaying their ranks' traffic, with
    assert ends["relayed faults in a phase"] > len(seeds) * 0.05, ends  # faults while they aggregate,
    assert ends["relayed nodes lost"] > len(seeds) * 0.03, ends  # a relay lost with its node,
    assert ends["relayed standbys in command"] > len(seeds) * 0.003, ends  # and a standby controller
    assert ends[RESIZING] > len(seeds) * 0.005, ends  # and a fault or a second lost node while they do
