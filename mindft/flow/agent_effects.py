"""What the node agent's policy (:class:`mindft.flow.agent.NodePolicy`) asks the node agent to do, as
values it carries out in order, and how the node's part of the job ends (:class:`Ending`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from mindft.flow.inputs import SchedulerLost
from mindft.protocol import ProcessExit


@dataclass(frozen=True)
class StartWorker:
    """Start ``rank``'s process (incarnation ``restarts``). ``renew_cluster``: first start a new
    MindSpore scheduler, as processes that restart together cannot join the old cluster.
    ``restore_from``: first put the rank's replica from the keeper there into the agent's memory."""

    rank: int
    restarts: int
    reason: str
    renew_cluster: bool = False
    restore_from: str = ""
    restore_rank: int = -1  # whose state the keeper serves, when not the rank's own


@dataclass(frozen=True)
class KillWorker:
    """Kill ``rank``'s process ``pid`` (SIGKILL: it is not asked, its state is in the agent's memory)."""

    rank: int
    pid: int
    reason: str


@dataclass(frozen=True)
class AbortJob:
    """This node fails the job: every rank is stopped and the node exits with ``exit_code`` (None:
    from the controller's verdict and the ranks' codes, as :func:`job_exit_code` combines them)."""

    reason: str
    exit_code: Optional[int] = None


@dataclass(frozen=True)
class BecomeSpare:
    """This agent's node was given to another agent, or its controller stood down for a newer term's
    at ``controller`` (""): stop every process it still runs (SIGKILL: the job has their state
    elsewhere), its controller and MindSpore's scheduler, stop replicating, and wait as a spare of
    the job's controller (:meth:`NodePolicy.spare_again`)."""

    reason: str
    controller: str = ""


@dataclass(frozen=True)
class Say:
    """One line for the people watching the launcher."""

    text: str


AgentEffect = Union[StartWorker, KillWorker, ProcessExit, SchedulerLost, AbortJob, BecomeSpare, Say]


@dataclass(frozen=True)
class Ending:
    """The node's part of the job is over: stop what still runs (``stop_running``), write the
    dying-gasp checkpoints of ranks without a process, then exit with :meth:`NodePolicy.exit_code`.
    ``controller``: the verdict the exit code starts from (None: the ranks' codes alone);
    ``code``: the exit code regardless of the ranks' (an unprotected job's failed rank)."""

    controller: Optional[int] = None
    stop_running: bool = False
    reason: str = ""
    code: Optional[int] = None
