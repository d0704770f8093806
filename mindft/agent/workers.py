"""The processes of one node: the workers (:class:`WorkerProcesses`: msrun's external agent's
kill a worker, start a list, monitor), MindSpore's :class:`Scheduler` on node 0, and the
:class:`Console` every rank's output goes through (the shared memory the ranks' snapshots live in
is :mod:`mindft.agent.memory`'s).

Mechanism only: when to start, kill or restart is the node agent's policy (:mod:`mindft.flow.agent`).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Mapping, Optional, Sequence, Union

from mindft.observe.events import ClusterFormed, EventLog, ProcessExitRecord, ProcessStartRecord
from mindft.agent.plan import DEFAULT_GRACE_PERIOD, LaunchSpec, rank_environment, scheduler_environment
from mindft.net.address import port_listening
from mindft.agent.warm import WarmProcess, WarmStarter

log = logging.getLogger(__name__)

# MindSpore's scheduler: MS_ROLE=MS_SCHED makes init() serve the cluster until every worker has
# unregistered. msrun runs the training script itself in this role; a command of its own keeps
# the script's code (argument parsing, output files) out of the scheduler, which needs none of it.
CLUSTER_FORMED_LINE = "Cluster is successfully initialized"  # in the scheduler's log (MindSpore 2.x)
# It dies with its parent (the agent, or a warm start's waiter): no scheduler outlives the agent.
SCHEDULER_COMMAND = ("-c", "from mindft.agent.zygote import die_with_parent; die_with_parent(); "
                           "from mindspore.communication import init; init()")
SCHEDULER_LISTEN_WAIT = 5.0  # for a started scheduler to listen, before the workers start


class Console:
    """Serialized, prefixed output of every rank and of the launcher."""

    def __init__(self, stream: Optional[IO[str]] = None, prefix: bool = True) -> None:
        self._stream = stream
        self._prefix = prefix
        self._lock = threading.Lock()

    def line(self, source: str, text: str) -> None:
        """Write one line, prefixed with ``[source]``."""
        stream = self._stream or sys.stdout
        if not text.endswith("\n"):
            text += "\n"
        with self._lock:
            try:
                stream.write(f"[{source}] {text}" if self._prefix else text)
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed console must not kill the launcher


Process = Union[subprocess.Popen, WarmProcess]

# MindSpore's own log lines ("[WARNING] ME(pid:tid,MainProcess):date [file:line] text", its C++
# modules' too: DISTRIBUTED, DEVICE, ...) below ERROR: the rank's log file keeps them, the console
# shows them only with --console-mindspore-logs, as msrun keeps them in its workers' log files.
# Errors, and whatever else a rank prints (its own lines, a traceback), reach the console.
_MINDSPORE_LOG_LINE = re.compile(rb"^\[(?:DEBUG|INFO|WARNING)\] [A-Z_]+\(\d+[:,]")


def for_the_console(line: bytes, mindspore_logs: bool) -> bool:
    """Whether a rank's output ``line`` goes to the console as well as to its log file."""
    return mindspore_logs or not _MINDSPORE_LOG_LINE.match(line)


def start_process(command: Sequence[str], env: Mapping[str, str], output: Optional[int],
                  warm: Optional[WarmStarter]) -> Process:
    """Start ``command`` forked from the warm process where it can run it, else cold; its output
    to the fd ``output``, or (None) to a pipe the returned process's ``stdout`` reads.

    A new session: the terminal's Ctrl-C reaches the launcher only, which forwards it, and
    killpg reaches whatever the process spawned."""
    if warm is not None and warm.available:
        read_end, write_end = os.pipe() if output is None else (-1, output)
        try:
            process = warm.spawn(command, env, write_end)
        finally:
            if output is None:
                os.close(write_end)
        if process is not None:
            if output is None:
                process.stdout = os.fdopen(read_end, "rb")
            return process
        if output is None:
            os.close(read_end)
    return subprocess.Popen(list(command), env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE if output is None else output, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True)


@dataclass
class WorkerProcess:
    """One local rank's current process."""

    rank: int
    log_path: Path
    process: Optional[Process] = None
    pump: Optional[threading.Thread] = None
    returncode: Optional[int] = None

    @property
    def pid(self) -> Optional[int]:
        """The pid of the running process, if any."""
        return self.process.pid if self.process is not None and self.returncode is None else None


class WorkerProcesses:
    """The workers of one node, as msrun's external agent handles them: start a list, kill,
    monitor. Each rank's output goes to its log file and, prefixed, to the console; each start
    and exit to ``events`` (the node's event log), if given."""

    def __init__(self, spec: LaunchSpec, console: Console, warm: Optional[WarmStarter] = None,
                 events: Optional[EventLog] = None) -> None:
        self.spec = spec
        self.console = console
        self.warm = warm
        self.events = events
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[int, WorkerProcess] = {}
        self.assign(spec)

    def assign(self, spec: LaunchSpec) -> None:
        """Run ``spec``'s ranks from now on (a spare that took a lost node's, or gave them up)."""
        self.spec = spec
        self.workers = {rank: self.workers.get(rank) or WorkerProcess(rank, spec.log_dir / f"rank_{rank}.log")
                        for rank in spec.local_ranks}

    def start(self, rank: int, restarts: int) -> int:
        """Start ``rank``'s process, incarnation ``restarts`` (MINDFT_RESTART_COUNT); its pid."""
        worker = self.workers[rank]
        if worker.pid is not None:
            raise RuntimeError(f"rank {rank} is still running (pid {worker.pid})")
        env = rank_environment(self.spec, rank, restarts)
        log_file = open(worker.log_path, "ab")
        log_file.write(f"--- mindft-launch: rank {rank}, incarnation {restarts}, "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
        log_file.flush()
        worker.process = start_process(self.spec.command, env, None, self.warm)
        worker.returncode = None
        worker.pump = threading.Thread(target=self._pump, args=(worker.process, rank, log_file),
                                       name=f"mindft-pump-{rank}", daemon=True)
        worker.pump.start()
        warm = isinstance(worker.process, WarmProcess)
        log.info("started rank %d (pid %d, restart %d, %s), log %s", rank, worker.process.pid, restarts,
                 "warm" if warm else "cold", worker.log_path)
        if self.events is not None:
            self.events.append(ProcessStartRecord("worker", worker.process.pid, rank, restarts, warm,
                                              _cold_reason(self.warm) if not warm else ""))
        return worker.process.pid

    def _pump(self, process: Process, rank: int, log_file: IO[bytes]) -> None:
        # The pump must outlive any failure to write a line: a dead pump leaves the rank's
        # pipe full and the rank blocked in print(), which no heartbeat would explain.
        assert process.stdout is not None
        failed: set[str] = set()
        try:
            for raw in iter(process.stdout.readline, b""):
                console = for_the_console(raw, self.spec.console_mindspore_logs)
                for where, write in (("log file", lambda: (log_file.write(raw), log_file.flush())),
                                     ("console", lambda: console and self.console.line(
                                         f"rank {rank}", raw.decode("utf-8", "replace").rstrip("\n")))):
                    try:
                        write()
                    except Exception as error:
                        if where not in failed:
                            failed.add(where)
                            log.error("rank %d: cannot write its output to the %s (%s: %s); "
                                      "still draining it", rank, where, type(error).__name__, error)
        except (OSError, ValueError) as error:
            log.error("rank %d: reading its output failed: %s", rank, error)
        finally:
            log_file.close()
            process.stdout.close()

    def monitor(self) -> dict[int, Optional[int]]:
        """Poll every local rank: rank → exit code, or None while it runs.

        A rank whose process exited since the last call gets its ``returncode`` set.
        """
        result: dict[int, Optional[int]] = {}
        for rank, worker in self.workers.items():
            if worker.process is not None and worker.returncode is None:
                worker.returncode = worker.process.poll()
            result[rank] = worker.returncode
        return result

    def exits(self) -> dict[int, int]:
        """The local ranks whose process exited since the last call: rank → exit code (each
        exit is returned once; the process handle is dropped)."""
        exited = {}
        for rank, code in self.monitor().items():
            worker = self.workers[rank]
            if code is not None and worker.process is not None:
                exited[rank] = code
                if self.events is not None:
                    self.events.append(ProcessExitRecord("worker", worker.process.pid, code, rank))
                worker.process = None
        return exited

    def signal_workers(self, ranks: Iterable[int], signum: int) -> None:
        """Send ``signum`` to the process group of each running rank."""
        for rank in ranks:
            worker = self.workers[rank]
            if worker.process is None or worker.process.poll() is not None:
                continue
            try:
                os.killpg(worker.process.pid, signum)
            except ProcessLookupError:
                pass
            except PermissionError as error:
                log.warning("cannot signal rank %d (pid %d): %s", rank, worker.process.pid, error)

    def kill_worker(self, ranks: Iterable[int], signum: int = signal.SIGTERM,
                    grace: float = DEFAULT_GRACE_PERIOD) -> None:
        """Stop the given ranks: ``signum``, up to ``grace`` seconds, then SIGKILL; waits for them."""
        ranks = [r for r in ranks if self.workers[r].process is not None]
        self.signal_workers(ranks, signum)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(self.workers[r].process.poll() is None for r in ranks):
            time.sleep(0.05)
        stubborn = [r for r in ranks if self.workers[r].process.poll() is None]
        if stubborn:
            log.warning("rank(s) %s did not stop within %.3gs; sending SIGKILL", stubborn, grace)
            self.signal_workers(stubborn, signal.SIGKILL)
            # A SIGSTOPped process still dies of SIGKILL; wait so no child outlives the launcher.
            for rank in stubborn:
                try:
                    self.workers[rank].process.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    log.error("rank %d (pid %d) survived SIGKILL", rank, self.workers[rank].process.pid)
        self.monitor()

    def running(self) -> list[int]:
        """Local ranks whose process is alive."""
        return [r for r, code in self.monitor().items()
                if code is None and self.workers[r].process is not None]

    def pids(self) -> dict[int, int]:
        """rank → pid of each running local rank."""
        return {r: w.pid for r, w in self.workers.items() if w.pid is not None}


def _cold_reason(warm: Optional[WarmStarter]) -> str:
    """Why a process started cold although the node has a warm path ('' when it has none)."""
    if warm is None:
        return ""
    return ("the warm path fell back to a cold start" if warm.available
            else "the warm start process failed; every start is cold (see the launcher's log)")


class Scheduler:
    """MindSpore's scheduler (``MS_ROLE=MS_SCHED``) on node 0, started before the workers as msrun does.

    Its output goes to ``LOG_DIR/scheduler.log`` only (as under msrun): MindSpore's cluster
    logging is verbose and says nothing about training.
    """

    def __init__(self, spec: LaunchSpec, warm: Optional[WarmStarter] = None,
                 events: Optional[EventLog] = None) -> None:
        self.spec = spec
        self.warm = warm
        self.events = events
        self.log_path = spec.log_dir / "scheduler.log"
        self.process: Optional[Process] = None
        self.exit_seen = False  # its exit was handled by the supervise loop
        # What cluster_formed() read of this process's log: from where, the last bytes (a line
        # split between two reads), and whether it found the cluster formed.
        self._read_from, self._tail, self._formed = 0, b"", False

    @property
    def address(self) -> str:
        """``host:port`` the workers connect to."""
        host = f"[{self.spec.master_ip}]" if ":" in self.spec.master_ip else self.spec.master_ip
        return f"{host}:{self.spec.scheduler_port}"

    @property
    def pid(self) -> Optional[int]:
        """The pid of the scheduler process, if it was started."""
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        """Start the scheduler process (a new session: the launcher forwards signals itself)."""
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self._read_from, self._tail, self._formed = os.fstat(log_file.fileno()).st_size, b"", False
            self.process = start_process((sys.executable, *SCHEDULER_COMMAND), scheduler_environment(self.spec),
                                         log_file.fileno(), self.warm)
        log.info("started MindSpore's scheduler on %s (pid %d), log %s", self.address, self.process.pid,
                 self.log_path)
        if self.events is not None:
            warm = isinstance(self.process, WarmProcess)
            self.events.append(ProcessStartRecord("scheduler", self.process.pid, warm=warm,
                                              detail=_cold_reason(self.warm) if not warm else ""))
        # Workers started before it listens fail to register and retry only after a sleep.
        deadline = time.monotonic() + SCHEDULER_LISTEN_WAIT
        while not port_listening(self.spec.scheduler_port) and self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def cluster_formed(self) -> bool:
        """True once its log says every worker joined (MindSpore's own WARNING-level line); the
        first time, the event log says so. Each call reads only what the process wrote since the last."""
        if self._formed:
            return True
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self._read_from)
                chunk = log_file.read()
        except OSError:
            return False
        self._read_from += len(chunk)
        text, line = self._tail + chunk, CLUSTER_FORMED_LINE.encode()
        self._tail = text[-len(line):]
        self._formed = line in text
        if self._formed and self.events is not None:
            self.events.append(ClusterFormed(self.pid or 0))
        return self._formed

    def poll(self) -> Optional[int]:
        """Its exit code, or None while it runs (or before it was started)."""
        return None if self.process is None else self.process.poll()

    def last_error(self) -> str:
        """The last error line of its log (MindSpore's own explanation of why it stopped), or ''.
        Not one from before the cluster formed, nor a retry of the forming cluster: its warnings
        while workers join say "timed out" too."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if CLUSTER_FORMED_LINE in line:
                return ""
            if any(word in line for word in ("Error", "ERROR", "CRITICAL", "timed out")) and "retry(" not in line:
                return line.strip()[:400]
        return ""

    def stop(self, wait: float, grace: float) -> Optional[int]:
        """Let it finish on its own for up to ``wait`` s, then SIGTERM, ``grace`` s, SIGKILL; its code."""
        process = self.process
        if process is None:
            return None
        for signum, timeout in ((None, wait), (signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if signum is not None and process.poll() is None:
                try:
                    os.killpg(process.pid, signum)
                except ProcessLookupError:
                    pass
            try:
                return process.wait(timeout)
            except subprocess.TimeoutExpired:
                continue
        log.error("MindSpore's scheduler (pid %d) survived SIGKILL", process.pid)
        return None
