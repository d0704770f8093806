"""A rank's watch of its node agent: once the agent is gone nothing restarts the rank or keeps its
snapshots, so the rank must end itself with its dying gasp (:meth:`mindft.rank.engine.RankEngine._agent_gone`).

The watch waits on a pidfd (Linux >= 5.3), without polling; elsewhere it does nothing.
"""
from __future__ import annotations

import logging
import os
import select
import sys
import threading
from typing import Callable, NoReturn, Optional


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's teardown, the logs and output flushed."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class AgentWatch:
    """Waits in a daemon thread, without polling (a pidfd), for the node agent's exit, then calls
    ``gone(pid, ending)``; ``ending`` is set once the rank ends on its own (Linux >= 5.3; elsewhere
    the watch does nothing)."""

    def __init__(self, pid: int, gone: Callable[[int, threading.Event], None]) -> None:
        self.ending = threading.Event()
        self.gone = False  # the agent exited
        self._wake_read, self._wake_write = os.pipe()
        try:
            agent: Optional[int] = os.pidfd_open(pid)
        except ProcessLookupError:
            agent = None  # gone already
        except (AttributeError, OSError):
            return
        threading.Thread(target=self._run, args=(pid, agent, gone), name="mindft-agent-watch", daemon=True).start()

    def _run(self, pid: int, agent: Optional[int], gone: Callable[[int, threading.Event], None]) -> None:
        if agent is not None:
            readable, _, _ = select.select([agent, self._wake_read], [], [])
            os.close(agent)
            if self._wake_read in readable:
                os.close(self._wake_read)
                return
        self.gone = True
        gone(pid, self.ending)

    def close(self) -> None:
        self.ending.set()
        try:
            os.write(self._wake_write, b"x")
            os.close(self._wake_write)
        except OSError:
            pass
