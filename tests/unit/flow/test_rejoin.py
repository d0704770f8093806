"""A controller started again (node 0 lost with it) finds the job under way and rebuilds it from
what the ranks and node agents say: message by message, no sockets (mindft.flow.rejoin)."""
from __future__ import annotations

from mindft.exitcodes import ExitCode
from mindft.flow import Broadcast, Job, JobState, KillRank, ProcessExited, RankState, Send, StartRank
from mindft.flow.rejoin import AgentSaid, Survivors
from mindft.protocol import (Ack, Action, ActionKind, AgentHello, Done, FaultKind, FaultReport, JobView, ProcessExit,
                             Register, StepReport)

from test_job import T

S = JobState
NODE0, NODE1 = b"", b"agent1"  # node 0's agent runs in the controller's process
KEEPER1 = "tcp://10.77.0.2:41000"


def hello(node: int, rank: int, pid: int, incarnation: int = 0, newest: int = -1, kept: dict[int, int] = {},
          keeper: str = "") -> AgentHello:
    return AgentHello(node, (rank,), (pid,), (incarnation,), (newest,), keeper, tuple(kept), tuple(kept.values()))


class NewController:
    """Two ranks, one per node; node 0 (its controller, its agent's memory, rank 0) lost and back:
    a fresh Job meets what survived on node 1."""

    def __init__(self) -> None:
        self.now = 100.0
        self.job = Job(2, T, self.now)
        self.effects: list = []

    def send(self, peer: bytes, message) -> list:
        out = self.job.handle(peer, message, self.now)
        self.effects += out
        return out

    def of(self, kind: type) -> list:
        return [e for e in self.effects if isinstance(e, kind)]

    def actions(self, kind: ActionKind) -> list[Action]:
        return [e.message for e in self.effects if isinstance(e, (Send, Broadcast)) and isinstance(e.message, Action)
                and e.message.kind is kind]

    def node0_back(self) -> None:
        """Node 0's new agent started rank 0 afresh (pid 500) and has nothing in memory."""
        self.send(NODE0, hello(0, 0, pid=500))

    def node1_says(self, pid: int = 201, newest: int = 7, kept: int = 7) -> None:
        """Node 1's agent: rank 1 runs (incarnation 2), its memory holds step ``newest``, its keeper
        rank 0's replica of step ``kept``."""
        self.send(NODE1, hello(1, 1, pid=pid, incarnation=2, newest=newest, kept={0: kept} if kept >= 0 else {},
                               keeper=KEEPER1))

    def rank1_reconnects(self, progress: int = 8) -> None:
        self.send(b"rank1.inc2", Register(1, 2, 201, (), "", collectives=True, progress=progress))

    def exits(self, rank: int, pid: int) -> None:
        self.effects += self.job.process_exit(ProcessExited(rank, -9, pid), self.now)

    def registers(self, rank: int, incarnation: int, held: tuple[int, ...]) -> None:
        self.send(f"rank{rank}.inc{incarnation}".encode(), Register(rank, incarnation, 600 + rank, held, ""))


def test_a_fresh_job_starts_as_always_whatever_the_agents_say_first() -> None:
    c = NewController()
    c.send(NODE0, hello(0, 0, pid=500))
    c.send(NODE1, hello(1, 1, pid=501, keeper=KEEPER1))
    c.send(b"rank0.inc0", Register(0, 0, 500))
    c.send(b"rank1.inc0", Register(1, 0, 501))
    assert c.job.state is S.NORMAL and not c.of(KillRank)


def test_node_0_lost_with_the_controller_restarts_every_worker_rank_0_from_its_replica() -> None:
    c = NewController()
    c.node0_back()
    c.rank1_reconnects()
    # Rank 1 got to step 8: the job was under way; node 1's agent has not said what it holds yet.
    assert c.job.state is S.STARTING and c.job.ladder.waiting_for() == (
        "the node agents of rank(s) [1] (the job was under way: this controller started again)")
    c.node1_says()
    assert c.job.state is S.REPAIRING and c.job.recovery.restart_all
    kills = {k.rank: (k.pid, k.agent) for k in c.of(KillRank)}
    assert kills == {0: (0, NODE0), 1: (201, NODE1)}  # rank 0 never registered: its agent kills what runs
    views = [e.message for e in c.effects if isinstance(e, Broadcast) and isinstance(e.message, JobView)]
    assert views[-1].state is S.REPAIRING and views[-1].restart_all  # rank 1 registered collectives
    fault = c.job.recovery.faults[0]
    assert (fault.node, fault.replica, fault.restore_from) == (0, (7,), KEEPER1)
    assert not c.of(StartRank)
    c.exits(0, 500)
    c.exits(1, 201)
    starts = {s.rank: s.restore_from for s in c.of(StartRank)}
    assert starts == {0: KEEPER1, 1: ""}
    assert c.of(StartRank)[0].order().restore_from == KEEPER1
    c.registers(0, 1, (7,))
    c.registers(1, 3, (6, 7))
    assert c.job.state is S.ROLLBACK and c.actions(ActionKind.ROLLBACK)[-1].step == 7
    for rank, incarnation in ((0, 1), (1, 3)):
        c.send(f"rank{rank}.inc{incarnation}".encode(), Ack(rank, ActionKind.ROLLBACK, 7, (7,), c.job.recovery.round))
    for rank, incarnation in ((0, 1), (1, 3)):
        c.send(f"rank{rank}.inc{incarnation}".encode(), Ack(rank, ActionKind.RESUME, 7, (), c.job.recovery.round))
    assert c.job.state is S.NORMAL and len(c.job.recoveries) == 1
    for rank, incarnation in ((0, 1), (1, 3)):
        c.send(f"rank{rank}.inc{incarnation}".encode(), StepReport(rank, 8))
        c.send(f"rank{rank}.inc{incarnation}".encode(), Done(rank, 8))
    assert c.job.state is S.DONE and c.job.result.exit_code == ExitCode.OK


def test_the_agents_say_it_before_any_rank_reconnects() -> None:
    c = NewController()
    c.node1_says(pid=0)  # rank 1's process is gone already (node 1's agent waits for a START)
    assert c.job.state is S.STARTING  # node 0's agent has not said anything yet
    c.node0_back()
    assert c.job.state is S.REPAIRING
    assert {k.rank: k.pid for k in c.of(KillRank)} == {0: 0}  # nothing runs for rank 1: nothing to kill
    c.exits(0, 500)
    assert {s.rank: s.restore_from for s in c.of(StartRank)} == {0: KEEPER1, 1: ""}


def test_the_old_process_registering_again_after_the_decision_is_not_taken_for_a_restart() -> None:
    c = NewController()
    c.node0_back()
    c.node1_says()
    assert c.job.state is S.REPAIRING
    c.rank1_reconnects()  # the same incarnation as its agent said: it is being killed
    assert c.job.ranks.get(1).state is RankState.DEAD and c.job.recovery.faults[1].process_pending


def test_a_rank_of_the_lost_node_without_a_replica_ends_the_job_with_dying_gasps() -> None:
    c = NewController()
    c.node0_back()
    c.node1_says(kept=-1)  # node 1's keeper holds nothing of rank 0
    c.exits(0, 500)
    c.exits(1, 201)
    assert c.job.state is S.FAILED and not c.of(StartRank)
    assert "rank 0" in c.job.result.reason and "replica" in c.job.result.reason


def test_a_replica_older_than_what_the_others_hold_ends_the_job_at_once() -> None:
    c = NewController()
    c.node0_back()
    c.node1_says(newest=12, kept=7)
    c.exits(0, 500)
    c.exits(1, 201)
    c.registers(1, 3, (11, 12))
    assert c.job.state is S.FAILED
    assert c.job.result.reason.startswith("node 0 lost: rank 0 only to step 7 (its replica) can roll back; rank 1 "
                                          "holds [11, 12]: no step every rank can restore")
    assert "rank 0 NODE LOST (node 0) in step 13 (node 0 lost with the controller; its replica of step 7 is on " \
           "node 1)" in c.job.result.reason


def test_the_job_fails_when_an_agent_never_says_hello() -> None:
    c = NewController()
    c.node0_back()
    c.rank1_reconnects()
    c.now += T.register + 1
    c.effects += c.job.tick(c.now)
    assert c.job.state is S.FAILED and "node agents of rank(s) [1]" in c.job.result.reason


def test_survivors_read_what_agents_and_ranks_say() -> None:
    survivors = Survivors(3)
    survivors.hello(AgentHello(0, (0,)))  # an agent that has not started its ranks says nothing yet
    assert survivors.unheard() == [0, 1, 2] and not survivors.under_way
    survivors.hello(hello(1, 1, pid=11, kept={0: 8}, keeper="tcp://b:1"))
    survivors.hello(hello(2, 2, pid=0, incarnation=4, newest=9, kept={0: 5}, keeper="tcp://c:1"))  # newest wins
    assert survivors.under_way and survivors.unheard() == [0]
    survivors.hello(hello(0, 0, pid=10))
    assert survivors.unheard() == []
    assert {r: (v.keeper, v.step, v.node) for r, v in survivors.replicas.items()} == {0: ("tcp://b:1", 8, 1)}
    assert survivors.agents[2] == AgentSaid(node=2, pid=0, incarnation=4, newest=9)
    assert set(survivors.lost()) == {0, 1}  # rank 2's agent holds step 9
    survivors.registered(1, 3)  # rank 1 reconnected: it got to step 3, its process holds its state
    assert set(survivors.lost()) == {0}


def test_what_happens_while_the_job_waits_to_be_rebuilt_does_not_end_it() -> None:
    """Rank 1 reconnected, node 0's agent has not said hello: rank 1's collective fails and its
    process exits; both are part of the restart to come, not a failure of a job that never started."""
    c = NewController()
    c.rank1_reconnects()
    c.node1_says()
    c.send(b"rank1.inc2", FaultReport(1, 9, FaultKind.COMMUNICATION, "peer gone"))
    c.send(NODE1, ProcessExit(1, -6, 201, will_restart=True))
    assert c.job.state is S.STARTING and c.job.ranks.get(1).state is RankState.DEAD
    c.node0_back()
    assert {k.rank: k.pid for k in c.of(KillRank)} == {0: 0}  # rank 1 has no process left to kill
    c.exits(0, 500)
    assert {s.rank: s.restore_from for s in c.of(StartRank)} == {0: KEEPER1, 1: ""}
