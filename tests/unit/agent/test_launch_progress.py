"""What the launcher prints about a recovery and about its own exit (pure, no processes)."""
from __future__ import annotations

from mindft.agent.links import recovery_progress
from mindft.cli.launch import job_verdict
from mindft.protocol import JobState, StatusReply


def _status(state: JobState, waiting: str = "", deadline_in: float = -1.0, reason: str = "") -> StatusReply:
    return StatusReply(state=state, step=41, round=3, reason=reason, waiting=waiting, deadline_in=deadline_in)


def test_progress_names_state_who_is_waited_on_and_time_left() -> None:
    status = _status(JobState.REPAIRING, "rank 1 (device not recovered), rank 2 (not re-registered)", 167.6,
                     reason="rank 1 DEVICE_RESET at step 42")
    assert recovery_progress(status, 12.4) == (
        "recovery 1: REPAIRING for 12s, waiting for rank 1 (device not recovered), rank 2 (not re-registered); "
        "168s left (timeouts.repair); faults: rank 1 DEVICE_RESET at step 42")


def test_progress_in_each_waiting_state_names_its_timeout() -> None:
    for state, name in ((JobState.PAUSING, "pause"), (JobState.ROLLBACK, "rollback"), (JobState.RESUMING, "resume")):
        line = recovery_progress(_status(state, "rank 1", 5.0), 1.0)
        assert line is not None and f"waiting for rank 1; 5s left (timeouts.{name})" in line


def test_no_progress_outside_a_recovery() -> None:
    for state in (JobState.STARTING, JobState.NORMAL, JobState.DONE, JobState.FAILED):
        assert recovery_progress(_status(state, "rank 0"), 3.0) is None


def test_job_verdict_says_what_the_exit_code_means() -> None:
    assert job_verdict(0) == "exit code 0: finished"
    assert job_verdict(3) == "exit code 3: dying-gasp checkpoint written"
    assert job_verdict(4) == "exit code 4: stopped; dying-gasp checkpoint NOT written"
    assert job_verdict(130) == "exit code 130: interrupted by SIGINT"
    assert job_verdict(143) == "exit code 143: interrupted by SIGTERM"
    assert job_verdict(9) == "exit code 9"
