"""The one table of exit codes used by every mindft process (ranks, launcher, controller, CLI).

Each code's meaning is written here once: :func:`describe` gives its first words (what the
launcher prints beside a rank's exit), :func:`explain` the whole sentence. ``mindft-launch
--help``, ``mindft --help`` (:func:`help_block`) and the README's "Exit codes" table say
exactly these words (tests/unit/test_docs.py compares them).
"""
from __future__ import annotations

import enum
import textwrap
from typing import Iterable


class ExitCode(enum.IntEnum):
    """What a mindft process's exit status means (:func:`explain` says it in words)."""

    OK = 0
    FAILED = 1
    USAGE = 2
    DUMPED = 3
    DUMP_FAILED = 4
    UNREACHABLE = 5
    LEFT_DEVICE = 6
    REWIND_REQUIRED = 7
    INTERRUPTED = 130


# Code → (the short description, the rest of the sentence): describe() is the first part, explain() both.
_MEANINGS: dict[ExitCode, tuple[str, str]] = {
    ExitCode.OK: ("finished", ": the job (or command) ended well"),
    ExitCode.FAILED: ("failed", ": the job failed and mindft saved nothing, or the script has a bug (every "
                                "rank's dying gasp written, nothing retried), or the command failed (the "
                                "launcher also passes on a crashed rank's own code)"),
    ExitCode.USAGE: ("usage or configuration error", ": nothing was started"),
    ExitCode.DUMPED: ("dying-gasp checkpoint written", ": stopped on purpose (the launcher: by every rank)"),
    ExitCode.DUMP_FAILED: ("stopped; dying-gasp checkpoint NOT written",
                           ": a rank had to stop but could not write its checkpoint"),
    ExitCode.UNREACHABLE: ("controller unreachable", " (mindft status, mindft inject)"),
    ExitCode.LEFT_DEVICE: ("left its device for a hot reset; restarted when the device is back",
                           " (a rank's exit, on the controller's order; never the launcher's)"),
    ExitCode.REWIND_REQUIRED: ("rolled back to an earlier step, which Model.train cannot re-enter by itself "
                               "(mindft.mindspore.RewindRequired)",
                               ": a rank's exit when the script does not catch it (use mindft.mindspore.train); "
                               "not restarted, the job fails with dying gasps"),
    ExitCode.INTERRUPTED: ("interrupted", ": 128 + the signal: 130 SIGINT, 143 SIGTERM"),
}


def describe(code: int) -> str:
    """A short human description of a process exit status (negative: killed by a signal)."""
    if code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    try:
        return _MEANINGS[ExitCode(code)][0]
    except ValueError:
        return f"exit code {code}"


def explain(code: ExitCode) -> str:
    """The whole meaning of ``code``, as the exit-code tables and ``--help`` state it."""
    return "".join(_MEANINGS[code])


def help_block(codes: Iterable[ExitCode] = tuple(ExitCode), title: str = "Exit codes:", width: int = 78) -> str:
    """An exit-code table for a click ``--help`` text: a ``\\b`` paragraph (click keeps its
    lines as they are), one code per entry, its :func:`explain` wrapped beside it."""
    lines = ["\b", title]
    for code in codes:
        lines += textwrap.wrap(explain(code), width, initial_indent=f"  {code.value:<5}",
                               subsequent_indent=" " * 7)
    return "\n".join(lines)


def describe_exit(code: int) -> str:
    """A rank's exit status for people, in the words of :func:`describe`."""
    if code < 0:
        return describe(code)
    meaning = describe(code)
    return f"exit {code}" if meaning == f"exit code {code}" else f"exit {code} ({meaning})"
