"""Ranks behind a relay (a node agent that carries its ranks' control traffic): the job's side.

A rank's own message comes from ``relay#rank``; a broadcast goes to ``relay#`` once per relay; a
node's acknowledgement of a phase (AckBatch) and its steps (StepBatch) count as each rank's own
would. No sockets: the job driven message by message with a fake clock."""
from __future__ import annotations

from mindft.flow import Broadcast, DeviceFaulty, DeviceRecovered, Job, JobState, RankState, Send
from mindft.flow.effects import broadcast_target
from mindft.flow.relay import Down, Relay, Up
from mindft.protocol import (Ack, AckBatch, Action, ActionKind, Done, FaultKind, FaultReport, Heartbeat, Progress,
                             Register, RegisterAck, StepBatch, StepReport)

from test_job import T

S = JobState
NODES, NPROC = 3, 4


def relay(node: int) -> bytes:
    return f"agent/{node}/77".encode()


def behind(rank: int) -> bytes:
    return relay(rank // NPROC) + b"#" + f"rank{rank}.inc0".encode()


def node_ranks(node: int) -> tuple[int, ...]:
    return tuple(range(node * NPROC, (node + 1) * NPROC))


def started(every: int = 1) -> tuple[Job, list]:
    job = Job(NODES * NPROC, T, 0.0, snapshot_every=every)
    effects = []
    for rank in range(NODES * NPROC):
        effects += job.handle(behind(rank), Register(rank, 0, 100 + rank, (0,)), 0.0)
    assert job.state is S.NORMAL
    return job, effects


def broadcasts(effects: list, kind: type) -> list[Broadcast]:
    return [e for e in effects if isinstance(e, Broadcast) and isinstance(e.message, kind)]


def test_a_broadcast_crosses_each_relay_once() -> None:
    job, effects = started()
    [barrier] = broadcasts(effects, RegisterAck)
    assert barrier.peers == tuple(relay(node) + b"#" for node in range(NODES))
    assert broadcast_target(behind(5)) == relay(1) + b"#"
    # ZeroMQ's own identities (a client that set none) may hold the separator: never a relay's.
    assert broadcast_target(b"\x00k#\x01\x02") == b"\x00k#\x01\x02"


def test_a_nodes_steps_advance_each_rank_and_are_its_heartbeat() -> None:
    job, _ = started()
    out = []
    for node in range(NODES):
        out = job.handle(relay(node), StepBatch(node_ranks(node), (3,) * NPROC), 1.0)
    assert job.ranks.slowest == 3
    assert [e.message for e in broadcasts(out, Progress)] == [Progress(3)]
    assert Send(relay(NODES - 1), Heartbeat(-1, 0, 3)) in out
    assert {r.last_seen for r in job.ranks} == {1.0}
    # One rank of node 0 behind: only it holds the job back.
    job.handle(relay(0), StepBatch((0, 1), (5, 4)), 2.0)
    job.handle(relay(1), StepBatch(node_ranks(1), (5,) * NPROC), 2.0)
    out = job.handle(relay(2), StepBatch(node_ranks(2), (5,) * NPROC), 2.0)
    assert job.ranks.slowest == 3 and job.ranks.get(1).progress == 4
    assert not broadcasts(out, Progress)


def test_a_relay_speaks_only_for_the_ranks_registered_through_it() -> None:
    job, _ = started()
    job.handle(relay(0), StepBatch((0, 4), (2, 9)), 1.0)  # rank 4 is node 1's
    assert job.ranks.get(0).progress == 2 and job.ranks.get(4).progress == 0
    assert job.ranks.get(4).last_seen == 0.0


def round_by(acks, job: Job) -> None:
    """One recovery round from a device reset of rank 5 reported with its recovery, each phase
    acknowledged through ``acks(job, action, step, round)``."""
    job.device(DeviceFaulty(5, "0x1", "reset"), 1.0)
    job.device(DeviceRecovered(5), 1.0)
    assert job.state is S.PAUSING
    acks(job, ActionKind.PAUSE, 0, job.recovery.round)
    assert job.state is S.ROLLBACK and job.recovery.repair_step == 0
    acks(job, ActionKind.ROLLBACK, 0, job.recovery.round)
    assert job.state is S.RESUMING
    acks(job, ActionKind.RESUME, 0, job.recovery.round)


def by_node(job: Job, action: ActionKind, step: int, round_: int) -> None:
    for node in range(NODES):
        job.handle(relay(node), AckBatch(action, step, node_ranks(node), (0,), round_), 1.5)


def by_rank(job: Job, action: ActionKind, step: int, round_: int) -> None:
    for rank in range(NODES * NPROC):
        job.handle(behind(rank), Ack(rank, action, step, (0,), round_), 1.5)


def test_a_round_acknowledged_by_nodes_is_the_round_acknowledged_by_ranks() -> None:
    outcomes = []
    for acks in (by_node, by_rank):
        job, _ = started()
        round_by(acks, job)
        outcomes.append((job.state, [s for s, _ in job.history], job.recoveries,
                         {r.rank: (r.state, r.held, r.held_round) for r in job.ranks}))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] is S.NORMAL and outcomes[0][2] == [0.5]


def test_a_phase_waits_for_every_node_and_ignores_another_rounds_batch() -> None:
    job, _ = started()
    job.device(DeviceFaulty(5, "0x1", "reset"), 1.0)
    job.device(DeviceRecovered(5), 1.0)
    round_ = job.recovery.round
    job.handle(relay(0), AckBatch(ActionKind.PAUSE, 0, node_ranks(0), (0,), round_ - 1), 1.1)
    assert job.recovery.waiting == set(range(NODES * NPROC))
    job.handle(relay(0), AckBatch(ActionKind.PAUSE, 0, node_ranks(0), (0,), round_), 1.1)
    # Node 1's ranks hold different steps: two batches, one per set of held steps.
    job.handle(relay(1), AckBatch(ActionKind.PAUSE, 0, (4, 5), (0,), round_), 1.1)
    assert job.state is S.PAUSING and job.recovery.waiting == {6, 7, 8, 9, 10, 11}
    job.handle(relay(1), AckBatch(ActionKind.PAUSE, 0, (6, 7), (0, 1), round_), 1.1)
    assert job.ranks.get(6).held == (0, 1) and job.ranks.get(4).state is RankState.PAUSED and job.ranks.get(5).state is RankState.FAULTY
    job.handle(relay(2), AckBatch(ActionKind.PAUSE, 0, node_ranks(2), (0,), round_), 1.2)
    assert job.state is S.ROLLBACK


def test_a_rank_behind_a_relay_is_still_addressed_alone() -> None:
    job, _ = started()
    out = job.handle(relay(1) + b"#rank5.inc0", Register(5, 1, 205, (0,)), 1.0)  # a new incarnation
    assert any(isinstance(e, Send) and e.peer == relay(1) + b"#rank5.inc0" for e in out)
    job.device(DeviceFaulty(6, "0x1", "reset"), 2.0)
    leave = [e for e in job.tick(2.0) + job.device(DeviceRecovered(6), 2.0)
             if isinstance(e, Send) and isinstance(e.message, Action)]
    assert all(e.peer.startswith(relay(1) + b"#") for e in leave)


# ---- the relay's own rules (mindft.flow.relay): what goes up, and when ----------------------------

def served(relay_: Relay, ranks=(0, 1, 2), now: float = 0.0) -> Relay:
    for rank in ranks:
        [up] = relay_.from_rank(f"rank{rank}.inc0".encode(), Register(rank, 0, 100 + rank, (0,)), now)
        assert up == Up(Register(rank, 0, 100 + rank, (0,)), f"rank{rank}.inc0".encode())  # its own, at once
    return relay_


def ack(relay_: Relay, rank: int, now: float, held=(0,), kind=ActionKind.PAUSE, step: int = 0, round_: int = 1):
    return relay_.from_rank(f"rank{rank}.inc0".encode(), Ack(rank, kind, step, held, round_), now)


def test_a_phase_goes_up_once_every_served_rank_acknowledged_it_grouped_by_held_steps() -> None:
    r = served(Relay(linger=0.05, interval=1.0, silent_after=2.0, now=0.0))
    assert ack(r, 0, 0.1) == [] and ack(r, 2, 0.1, held=(0, 1)) == []
    assert ack(r, 0, 0.1) == []  # said twice: still one rank
    assert ack(r, 1, 0.1) == [Up(AckBatch(ActionKind.PAUSE, 0, (0, 1), (0,), 1)),
                              Up(AckBatch(ActionKind.PAUSE, 0, (2,), (0, 1), 1))]
    assert ack(r, 1, 0.2) == [Up(Ack(1, ActionKind.PAUSE, 0, (0,), 1), b"rank1.inc0")]  # late: at once, itself


def test_a_rank_that_does_not_answer_holds_its_node_back_only_for_the_linger() -> None:
    r = served(Relay(linger=0.05, interval=1.0, silent_after=2.0, now=0.0))
    ack(r, 0, 0.1)
    ack(r, 1, 0.1)
    assert r.tick(0.12) == [] and r.next_wakeup() == 0.1 + 0.05
    assert r.tick(0.16) == [Up(AckBatch(ActionKind.PAUSE, 0, (0, 1), (0,), 1))]
    # A rank whose process is gone is not waited for at all.
    ack(r, 0, 0.2, kind=ActionKind.RESUME)
    ack(r, 1, 0.2, kind=ActionKind.RESUME)
    assert r.rank_left(2, 0.21) == [Up(AckBatch(ActionKind.RESUME, 0, (0, 1), (0,), 1))]


def test_a_ranks_messages_reach_the_controller_in_the_order_it_sent_them() -> None:
    """Found by the explorer: a Done that overtook its rank's RESUME ack, held for the node's others,
    was taken for one sent before the round, and the job never ended."""
    r = served(Relay(linger=0.05, interval=1.0, silent_after=2.0, now=0.0))
    ack(r, 0, 0.1, kind=ActionKind.RESUME)
    assert r.from_rank(b"rank0.inc0", Done(0, 8), 0.1) == [Up(AckBatch(ActionKind.RESUME, 0, (0,), (0,), 1)),
                                                            Up(Done(0, 8), b"rank0.inc0")]
    assert ack(r, 1, 0.1, kind=ActionKind.RESUME) == [Up(Ack(1, ActionKind.RESUME, 0, (0,), 1), b"rank1.inc0")]
    # Steps held at the relay go up before a rank's own message too, and held acks before steps.
    steps(r, 0.2, r0=3)
    ack(r, 2, 0.2, kind=ActionKind.PAUSE, round_=2)
    out = r.from_rank(b"rank0.inc0", FaultReport(0, 4, FaultKind.UCE), 0.2)
    assert [type(up.message) for up in out] == [AckBatch, StepBatch, FaultReport]


def steps(r: Relay, now: float, **by_rank: int) -> list:
    out = []
    for name, step in by_rank.items():
        rank = int(name[1:])
        out += r.from_rank(f"rank{rank}.inc0".encode(), StepReport(rank, step, 0), now)
    return out


def test_steps_go_up_when_the_nodes_slowest_rose_and_as_its_heartbeat() -> None:
    r = served(Relay(linger=0.05, interval=1.0, silent_after=2.0, now=0.0))
    assert steps(r, 0.1, r0=1, r1=1) == []
    assert steps(r, 0.1, r2=1) == [Up(StepBatch((0, 1, 2), (1, 1, 1), 0))]
    assert steps(r, 0.2, r0=2, r2=2) == []  # rank 1 holds the node at step 1
    assert r.tick(0.5) == []
    # An interval with nothing sent up: the node's heartbeat, vouching for the ranks heard lately.
    assert r.tick(1.21) == [Up(StepBatch((0, 1, 2), (2, 1, 2), 0))]
    steps(r, 1.5, r0=3, r2=3)
    assert r.tick(3.3) == [Up(StepBatch((0, 2), (3, 3), 0))]  # rank 1 silent for 3.2 s: not vouched for
    # A rank's heartbeat stops at the relay, answered with the job's progress it last heard while the
    # controller is heard: a silent controller is still found by the rank.
    r.from_controller(Progress(2), 3.0)
    assert r.from_rank(b"rank1.inc0", Heartbeat(1, 0, 1), 3.4) == [Down(b"rank1.inc0", Heartbeat(-1, 0, 2))]
    assert r.from_rank(b"rank1.inc0", Heartbeat(1, 0, 1), 5.1) == []


def test_a_relay_that_follows_another_controller_counts_its_rounds_afresh() -> None:
    r = served(Relay(linger=0.05, interval=1.0, silent_after=2.0, now=0.0))
    for rank in range(3):
        r.from_rank(f"rank{rank}.inc0".encode(), StepReport(rank, 9, 4), 0.1)
    ack(r, 0, 0.1, round_=4)
    r.new_controller()  # a standby took command: its first round is 0
    assert steps(r, 0.2, r0=1, r1=1) == [] and steps(r, 0.2, r2=1) == [Up(StepBatch((0, 1, 2), (1, 1, 1), 0))]
    assert r.tick(5.0)[-1] == Up(StepBatch((), (), 0))  # nothing held for the old one; nobody heard lately


def test_relays_in_front_of_the_job_make_the_round_the_ranks_make_alone() -> None:
    """Each rank's ack through its node's relay, what the relays send up fed to the job: the same
    round as the ranks' acks straight to the job (test_a_round_acknowledged_by_nodes_is_...)."""
    relays = [Relay(linger=0.05, interval=10.0, silent_after=20.0, now=0.0) for _ in range(NODES)]

    def through_relays(job: Job, action: ActionKind, step: int, round_: int) -> None:
        for rank in range(NODES * NPROC):
            node = rank // NPROC
            for up in relays[node].from_rank(f"rank{rank}.inc0".encode(),
                                             Ack(rank, action, step, (0,), round_), 1.5):
                peer = relay(node) + (b"#" + up.identity if up.identity else b"")
                job.handle(peer, up.message, 1.5)

    outcomes = []
    for acks in (through_relays, by_rank):
        job, _ = started()
        for node, r in enumerate(relays):
            for rank in node_ranks(node):
                r.from_rank(f"rank{rank}.inc0".encode(), Heartbeat(rank, 0, 0), 0.0)  # served
        round_by(acks, job)
        outcomes.append((job.state, [s for s, _ in job.history], job.recoveries,
                         {r.rank: (r.state, r.held) for r in job.ranks}))
    assert outcomes[0] == outcomes[1] and outcomes[0][0] is S.NORMAL
