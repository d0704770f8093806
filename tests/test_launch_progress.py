"""What the launcher prints about a recovery and about its own exit (pure, no processes)."""
from __future__ import annotations

from mindft.config import Timeouts
from mindft.launch import job_verdict, recovery_progress
from mindft.protocol import RankStatus, StatusReply


def _status(state: str, *rows: tuple[int, str], reason: str = "", round: int = 1) -> StatusReply:
    return StatusReply(state=state, step=41, round=round, reason=reason,
                       ranks=tuple(RankStatus(rank=r, state=s, step=41, last_heartbeat_age=0.1, restarts=0, pid=1)
                                   for r, s in rows))


def test_progress_names_state_who_is_waited_on_and_time_left() -> None:
    status = _status("REPAIRING", (0, "paused"), (1, "faulty"), (2, "dead"), (3, "paused"),
                     reason="rank 1 DEVICE_RESET at step 42")
    line = recovery_progress(status, 12.4, Timeouts(repair=180.0))
    assert line == ("recovery round 1: REPAIRING for 12s, waiting for rank 1 (device not recovered), "
                    "rank 2 (process not back) to be repaired; 168s left (timeouts.repair); "
                    "faults: rank 1 DEVICE_RESET at step 42")


def test_progress_names_a_rank_whose_node_was_lost() -> None:
    line = recovery_progress(_status("REPAIRING", (0, "paused"), (1, "lost")), 2.0, Timeouts(repair=180.0))
    assert line is not None and ("waiting for rank 1 (its node was lost; waiting for the node that replaces it) "
                                 "to be repaired") in line


def test_progress_in_each_waiting_state() -> None:
    timeouts = Timeouts(pause=60.0, rollback=100.0, resume=30.0)
    pausing = recovery_progress(_status("PAUSING", (0, "paused"), (1, "running")), 5.0, timeouts)
    assert pausing is not None and "waiting for rank 1 to pause; 55s left (timeouts.pause)" in pausing
    rollback = recovery_progress(_status("ROLLBACK", (0, "restored"), (1, "paused")), 99.6, timeouts)
    assert rollback is not None and "waiting for rank 1 to restore; 0s left (timeouts.rollback)" in rollback
    resuming = recovery_progress(_status("RESUMING", (0, "resumed"), (1, "restored")), 1.0, timeouts)
    assert resuming is not None and "rank 1 to resume; 29s left" in resuming


def test_no_progress_outside_a_recovery() -> None:
    for state in ("STARTING", "NORMAL", "DONE", "FAILED"):
        assert recovery_progress(_status(state, (0, "running")), 3.0, Timeouts()) is None


def test_job_verdict_says_what_the_exit_code_means() -> None:
    assert job_verdict(0) == "exit code 0: finished"
    assert job_verdict(3) == "exit code 3: dying-gasp checkpoint written"
    assert job_verdict(4) == "exit code 4: stopped; dying-gasp checkpoint NOT written"
    assert job_verdict(130) == "exit code 130: interrupted by SIGINT"
    assert job_verdict(143) == "exit code 143: interrupted by SIGTERM"
    assert job_verdict(7) == "exit code 7"
