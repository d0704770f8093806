"""The one table of exit codes used by every mindft process (ranks, launcher, controller, CLI).

Documented once, in the README's "Exit codes" section; every module imports from here.
"""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What a mindft process's exit status means."""

    OK = 0             # the job (or command) finished
    FAILED = 1         # the job failed, nothing was saved by mindft (or the command failed)
    USAGE = 2          # bad command line or configuration; nothing was started
    DUMPED = 3         # stopped on purpose after writing a dying-gasp checkpoint
    DUMP_FAILED = 4    # stopped on purpose, but the dying-gasp checkpoint could not be written
    UNREACHABLE = 5    # the controller did not answer (CLI)
    LEFT_DEVICE = 6    # left its device on the controller's order (hot reset); started again when it is back
    REWIND_REQUIRED = 7  # rolled back to an earlier step that Model.train cannot go back to by itself
    INTERRUPTED = 130  # stopped by SIGINT/SIGTERM (128 + SIGINT, as shells report it)


def describe(code: int) -> str:
    """A short human description of a process exit status (negative: killed by a signal)."""
    if code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    try:
        return {ExitCode.OK: "finished", ExitCode.FAILED: "failed",
                ExitCode.USAGE: "usage or configuration error",
                ExitCode.DUMPED: "dying-gasp checkpoint written",
                ExitCode.DUMP_FAILED: "stopped; dying-gasp checkpoint NOT written",
                ExitCode.UNREACHABLE: "controller unreachable",
                ExitCode.LEFT_DEVICE: "left its device for a hot reset; restarted when the device is back",
                ExitCode.REWIND_REQUIRED: "rolled back to an earlier step, which Model.train cannot re-enter "
                                          "by itself (mindft.mindspore.RewindRequired)",
                ExitCode.INTERRUPTED: "interrupted"}[ExitCode(code)]
    except ValueError:
        return f"exit code {code}"
