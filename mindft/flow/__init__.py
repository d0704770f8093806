"""The recovery rules, with no I/O: states and table, the rank table, the job, the rank follower.

Nothing in this package imports zmq, threading, socket or time (a test enforces it): every
input carries the time it happened, every decision comes back as a value.
"""
from __future__ import annotations

from mindft.flow.effects import (Broadcast, Effect, Fence, Finish, GiveNode, KillRank, Peer, Promoted, Resize, Send,
                                 SlowRank, StartRank, Transition)
from mindft.flow.inputs import (DeviceFailed, DeviceFaulty, DeviceInput, DeviceRecovered, HoldRepairs, ProcessExited,
                                RollbackAll, StopJob)
from mindft.flow.follower import (ArmFault, Armed, Command, DumpAndExit, Finished, Follower, Ignore, Leave,
                                  LeaveDevice, Outcome, RankHooks, Restore, Resume, Resumed, Settle)
from mindft.flow.episode import phase_times
from mindft.flow.job import Job, held_after
from mindft.flow.ranks import RankRecord, RankState, RankTable
from mindft.flow.states import (RECOVERY_STATES, TERMINAL_STATES, TRANSITIONS, Event, IllegalTransition, JobState,
                                next_state)

__all__ = ["Armed", "Finished", "Outcome", "RankHooks", "Resumed", "ArmFault", "Broadcast", "Command", "DeviceFailed",
           "DeviceFaulty", "DeviceInput", "DeviceRecovered", "DumpAndExit", "Effect", "Event", "Fence", "Finish",
           "GiveNode", "Follower", "HoldRepairs", "RollbackAll", "StartRank", "Ignore", "IllegalTransition", "Job",
           "JobState", "KillRank", "Leave", "Peer", "Promoted", "ProcessExited", "RECOVERY_STATES", "RankRecord",
           "RankState", "RankTable", "LeaveDevice", "Resize", "Restore", "Resume", "Send", "Settle", "SlowRank", "StopJob",
           "TERMINAL_STATES", "TRANSITIONS", "Transition", "held_after", "next_state", "phase_times"]
