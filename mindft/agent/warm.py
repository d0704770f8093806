"""The node agent's side of warm starts: :class:`WarmStarter` runs the warm process
(:mod:`mindft.agent.zygote`) and asks it for workers; :class:`WarmProcess` is such a worker, handled as
the agent handles a :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``stdout``).

The agent itself never forks (its ZeroMQ threads make that unsafe); the warm process is a
single-threaded interpreter started for that purpose. When it is off (``MINDFT_WARM_START=0``), gone,
or cannot run a command (not ``python SCRIPT``, ``-c`` or ``-m``, or other ``PYTHON*`` variables),
:meth:`WarmStarter.spawn` returns None and the agent starts the process cold.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Mapping, Optional, Sequence

from mindft.observe.procfs import proportional_set_size
from mindft.observe.units import size_text
from mindft.agent.zygote import PRELOAD_VARIABLE, READY, ForkRequest, runnable

log = logging.getLogger(__name__)

READY_TIMEOUT = 120.0  # for the warm process to import its modules: MindSpore (2-3 s; minutes on a loaded node)
PID_TIMEOUT = 10.0     # for a waiter to say its worker's pid
WARM_COMMAND = ("-c", "from mindft.agent.zygote import serve; serve()")


def _interpreter_settings(env: Mapping[str, str]) -> dict[str, str]:
    """What an interpreter reads once at its start and a fork keeps: the PYTHON* variables."""
    return {name: value for name, value in env.items() if name.startswith("PYTHON")}


class WarmProcess:
    """A worker forked by the warm process, as the agent handles a Popen."""

    def __init__(self, pid: int, status: IO[bytes], stdout: Optional[IO[bytes]]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: Optional[int] = None
        self._status = status

    def poll(self) -> Optional[int]:
        """Its exit code once it ended (Popen's convention), else None."""
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Its exit code; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"warm worker {self.pid}", timeout)
            self._read(left)
        return self.returncode

    def _read(self, timeout: Optional[float]) -> None:
        if not select.select([self._status], [], [], timeout)[0]:
            return
        line = self._status.readline().decode(errors="replace").split()
        if line[:1] == ["exit"] and len(line) == 2:
            self.returncode = int(line[1])
        else:  # the waiter died without a word (killed with its process group's owner?)
            log.error("warm worker %d: its exit status was lost (%s); counted as a failure", self.pid,
                      " ".join(line) or "the waiter ended")
            self.returncode = 1
        self._status.close()


class WarmStarter:
    """The warm process of one node agent, started at once and used as soon as it is ready."""

    def __init__(self, env: Mapping[str, str], log_path: Path, preload: str = "") -> None:
        self._env = dict(env)
        if preload:
            self._env[PRELOAD_VARIABLE] = preload
        self.log_path = log_path
        self._lock = threading.Lock()
        self._ready = False
        self._gone: Optional[str] = None  # why warm starts stopped, once said
        self.forked = 0
        self.idle_pss: Optional[int] = None  # bytes, measured when it became ready
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one request per message
        self._control = ours
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, *WARM_COMMAND, str(theirs.fileno())], env=self._env,
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
                start_new_session=True)
        theirs.close()
        log.info("warm start process pid %d importing %s, log %s", self.process.pid, preload or "nothing", log_path)

    @property
    def pid(self) -> int:
        """The warm process's pid."""
        return self.process.pid

    @property
    def available(self) -> bool:
        """True while workers can be forked (the warm process ready, or still getting ready)."""
        return self._gone is None

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], output: int) -> Optional[WarmProcess]:
        """Fork ``argv`` with ``env`` in the agent's working directory, its output to the fd
        ``output`` (and the returned handle's ``stdout`` None). None: start it cold."""
        if not runnable(argv, sys.executable):
            return None
        if _interpreter_settings(env) != _interpreter_settings(self._env):
            log.info("warm start: %s differ from the warm process's; starting cold", sorted(
                set(_interpreter_settings(env).items()) ^ set(_interpreter_settings(self._env).items())))
            return None
        with self._lock:
            if not self._wait_ready():
                return None
            status_read, status_write = os.pipe()
            request = ForkRequest(tuple(argv), tuple(sorted(env.items())), os.getcwd())
            try:
                socket.send_fds(self._control, [request.encode()], [output, status_write])
            except OSError as error:
                os.close(status_read)
                self._give_up(f"it no longer takes requests ({error})")
                return None
            finally:
                os.close(status_write)
        status = os.fdopen(status_read, "rb")
        if not select.select([status], [], [], PID_TIMEOUT)[0]:
            status.close()
            self._give_up(f"no worker pid within {PID_TIMEOUT:g} s")
            return None
        line = status.readline().decode(errors="replace").split()
        if line[:1] != ["pid"] or len(line) != 2:
            status.close()
            self._give_up(f"it answered {' '.join(line) or 'nothing'!r}")
            return None
        self.forked += 1
        return WarmProcess(int(line[1]), status, None)

    def _wait_ready(self) -> bool:
        if self._gone is not None:
            return False
        if self._ready:
            if self.process.poll() is None:
                return True
            self._give_up(f"it exited with code {self.process.returncode}")
            return False
        if not select.select([self._control], [], [], READY_TIMEOUT)[0]:
            self._give_up(f"it did not import {self._env.get(PRELOAD_VARIABLE, 'its modules')} within "
                          f"{READY_TIMEOUT:g} s")
            return False
        if self._control.recv(len(READY)) != READY:
            self._give_up(f"it exited while importing {self._env.get(PRELOAD_VARIABLE, 'its modules')} "
                          f"(see {self.log_path})")
            return False
        self._ready = True
        self.idle_pss = proportional_set_size(self.pid)
        return True

    def _give_up(self, why: str) -> None:
        """Cold starts from now on; said once."""
        if self._gone is None:
            self._gone = why
            log.warning("warm start process (pid %d) failed: %s; workers start cold from now on", self.pid, why)
            self.close()

    def summary(self) -> str:
        """One line for the launcher's end: what the warm path did and the memory it held."""
        memory = "" if self.idle_pss is None else f"; idle, it held {size_text(self.idle_pss)} (PSS)"
        state = f"failed: {self._gone}; " if self._gone is not None else ""
        return f"warm start: {state}{self.forked} process(es) forked from pid {self.pid}{memory}"

    def close(self) -> None:
        """Stop the warm process (its workers go on; their waiters still report them)."""
        self._control.close()
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(10.0)
        except subprocess.TimeoutExpired:
            log.error("warm start process (pid %d) survived SIGKILL", self.pid)
