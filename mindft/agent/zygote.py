"""The warm process: a Python interpreter that has imported what ``MINDFT_PRELOAD`` names (MindSpore
by default) and nothing else, from which the node agent forks its workers and MindSpore's scheduler.

A restart then costs a ``fork()`` instead of an interpreter start and ``import mindspore`` (~2.5 s
of CPU per process, all of them at once). The agent starts it as
``python -c "from mindft.agent.zygote import serve; serve()" FD`` with the job's environment and talks to it
over one Unix socket (:mod:`mindft.agent.warm`). Each request is a :class:`ForkRequest` with two file
descriptors: the worker's output and a status pipe. The warm process forks a *waiter*, which forks
the worker, writes ``pid N`` and, once the worker ended, ``exit CODE`` (Popen's convention: ``-N``
for a signal) to the status pipe. The waiter, not the warm process, is the worker's parent, so an
exit is reported even after the warm process is gone; the waiter ends with the node agent (it
watches the agent's pid), so nothing it started outlives the agent: MindSpore's scheduler dies
with its parent (:func:`die_with_parent` in its command), a rank ends itself with its dying
gasp (:mod:`mindft.rank.engine`).

The worker becomes what a cold start gives: its own session, output on fds 1 and 2, stdin from
/dev/null, the request's working directory, environment and ``sys.argv``, the signal dispositions
and mask of a fresh interpreter, fresh random seeds, ``sys.path[0]`` the script's directory, and a
clean ``__main__`` in which the script runs from its first line (its ``import mindspore`` finds the
module loaded). What a fork cannot give: variables read when the interpreter started (``PYTHON*``:
the agent forks only requests whose ``PYTHON*`` variables equal this process's) and the string hash
seed, which every worker shares with the warm process.

This module imports nothing of mindft's that starts threads: a process with threads must not fork.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib
import json
import logging
import os
import select
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

WARM_PROTOCOL_VERSION = 1
PRELOAD_VARIABLE = "MINDFT_PRELOAD"
READY = b"ready"
_PR_SET_PDEATHSIG = 1
_MAX_REQUEST = 1 << 22


@dataclass(frozen=True)
class ForkRequest:
    """Start one process: what ``subprocess.Popen(argv, env=env, cwd=cwd)`` would run."""

    argv: Tuple[str, ...]
    env: Tuple[Tuple[str, str], ...]
    cwd: str
    version: int = WARM_PROTOCOL_VERSION

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> ForkRequest:
        body = json.loads(data)
        if body.get("version") != WARM_PROTOCOL_VERSION:
            raise ValueError(f"warm start request of version {body.get('version')!r}; "
                             f"this warm process speaks {WARM_PROTOCOL_VERSION}")
        return cls(tuple(body["argv"]), tuple((str(k), str(v)) for k, v in body["env"]), str(body["cwd"]))


def runnable(argv: Sequence[str], executable: str) -> bool:
    """True when ``argv`` is this interpreter running a script, ``-c CODE`` or ``-m MODULE`` with no
    interpreter options: what a forked worker can become."""
    if len(argv) < 2 or argv[0] != executable:
        return False
    return argv[1] in ("-c", "-m") and len(argv) >= 3 or not argv[1].startswith("-")


# ---- the warm process ------------------------------------------------------------------------------

def serve() -> None:
    """Preload, say ready, then fork a waiter per request until the agent closes its end."""
    die_with_parent()
    agent = os.getppid()
    control = socket.socket(fileno=int(sys.argv[1]))  # its end of the agent's socket
    preload = [name.strip() for name in os.environ.pop(PRELOAD_VARIABLE, "").split(",") if name.strip()]
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as error:  # the workers will import it themselves, and fail there if they must
            log.warning("warm process: cannot preload %s (%s: %s)", name, type(error).__name__, error)
    _title(f"mindft warm process (preloaded: {', '.join(preload) or 'nothing'}; forks this node's workers)")
    control.sendall(READY)
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    previous_chld = signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select
    while True:
        readable, _, _ = select.select([control, wakeup_read], [], [])
        if wakeup_read in readable:
            os.read(wakeup_read, 4096)
            _reap()
        if control not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST, 2)
        except OSError:
            return
        if not data:
            return  # the agent is gone
        worker = _fork_waiter(data, fds, control, (wakeup_read, wakeup_write), previous_chld, agent)
        if worker is not None:
            break
    # The worker: returning from here ends the interpreter as a cold start's script would.
    _become(*worker)


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the agent stops it at the end anyway


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _fork_waiter(data: bytes, fds: Sequence[int], control: socket.socket, wakeup: Tuple[int, int],
                 previous_chld: Any, agent: int) -> Optional[Tuple[ForkRequest, int]]:
    """Fork the waiter for one request. The warm process gets None and goes on; the waiter forks
    the worker and reports on it until it ends; the worker gets its request and output fd."""
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        log.error("warm process: a request without its two file descriptors; ignored")
        return None
    output, status = fds
    waiter = os.fork()
    if waiter:
        os.close(output)
        os.close(status)
        return None
    # The waiter: nothing of the warm process's but the request.
    control.close()
    signal.set_wakeup_fd(-1)
    for fd in wakeup:
        os.close(fd)
    signal.signal(signal.SIGCHLD, previous_chld)
    os.setpgid(0, 0)  # out of the warm process's group: stopping that one must not lose an exit
    try:
        request = ForkRequest.decode(data)
        worker = os.fork()
    except Exception as error:
        os.write(status, f"error {type(error).__name__}: {error}\n".encode())
        os._exit(1)
    if worker == 0:
        os.close(status)
        return request, output
    os.close(output)
    _title(f"mindft warm waiter of pid {worker} ({_role(dict(request.env)) or 'a process'})")
    os.write(status, f"pid {worker}\n".encode())
    if not _wait_for_exit(worker, agent):
        os._exit(0)  # the agent is gone: nobody to report to, and nothing of the job may outlive it
    _, code = os.waitpid(worker, 0)
    os.write(status, f"exit {os.waitstatus_to_exitcode(code)}\n".encode())
    os._exit(0)


def _wait_for_exit(worker: int, agent: int) -> bool:
    """Wait until ``worker`` exited (True) or the agent did (False), without polling."""
    try:
        watched = [os.pidfd_open(worker)]
    except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): the worker alone
        return True
    try:
        watched.append(os.pidfd_open(agent))
    except ProcessLookupError:
        return False
    except OSError:
        return True
    while True:
        try:
            readable, _, _ = select.select(watched, [], [])
        except InterruptedError:
            continue
        return watched[0] in readable


def _become(request: ForkRequest, output: int) -> None:
    """The worker: turn this fork into what ``python ARGV`` started cold would be, then run it."""
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        for fd in (null, output):
            os.close(fd)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(dict(request.env))
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        _fresh_stdio()
        _fresh_random()
        # ps, top and tools that find a job's processes by their command line see what a cold start
        # shows (not the warm process's), and which of the job's processes it is.
        role = _role(os.environ)
        _title(" ".join(request.argv) + (f"  [mindft {role}]" if role else ""))
    except BaseException as error:
        os.write(2, f"mindft warm start: cannot become the worker: {error!r}\n".encode())
        os._exit(1)
    _run(request.argv)


def _role(env: Any) -> str:
    """Which of a job's processes ``env`` (a process's environment, as msrun sets it) starts: a rank, or
    MindSpore's scheduler ("": neither)."""
    if env.get("MS_ROLE") == "MS_SCHED":
        return "MindSpore's scheduler"
    return f"rank {env['RANK_ID']}" if env.get("RANK_ID") else ""


def _title(text: str) -> None:
    """This process's title in ps, top and /proc/PID/cmdline."""
    from setproctitle import setproctitle

    setproctitle(text)


def _fresh_stdio() -> None:
    """stdin, stdout and stderr on fds 0-2, buffered as the interpreter would have made them."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        stream = open(fd, mode, buffering=1 if mode == "w" and not unbuffered else -1, closefd=False,
                      errors="backslashreplace" if name == "stderr" else None)
        if unbuffered and mode == "w":
            stream.reconfigure(write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_random() -> None:
    """Seeds from the OS, as a new process draws them (a fork shares the warm process's)."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run(argv: Sequence[str]) -> None:
    """Run ``python ARGV[1:]`` in this process's ``__main__``; exceptions and SystemExit end the
    interpreter as they would a cold start."""
    import __main__
    import builtins
    import runpy

    sys.orig_argv = list(argv)
    namespace = __main__.__dict__
    namespace.clear()
    namespace.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None,
                     __loader__=None, __builtins__=builtins)
    if argv[1] == "-m":
        sys.argv = ["-m", *argv[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        return
    if argv[1] == "-c":
        sys.argv = ["-c", *argv[3:]]
        sys.path[0] = ""
        code = compile(argv[2], "<string>", "exec")
    else:
        script = argv[1]
        sys.argv = list(argv[1:])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        namespace["__file__"] = os.path.abspath(script)  # as Python 3.9+ gives __main__
        namespace["__cached__"] = None
        with open(script, "rb") as handle:
            code = compile(handle.read(), script, "exec")
    exec(code, namespace)

