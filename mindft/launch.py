"""``mindft-launch``: start, watch and restart the ranks of one node, plus the controller on node 0.

It runs MindSpore's cluster as msrun does (the scheduler on node 0, the workers'
``MS_ROLE``/``MS_SCHED_*`` environment, msrun's flag names as synonyms: what to run is
planned by :mod:`mindft.launch_plan`) and plays the role msrun hands to MindCluster's
external agent when ``MS_ENABLE_TFT`` asks for fault tolerance: the agent of
:mod:`mindft.workers` can kill a worker, start all workers, start a list of workers and
monitor them; :class:`Launcher` adds the policy (restart a crashed rank up to
``--max-restarts`` times, forward signals, run the controller and the reset watcher,
replace a lost node, decide the exit code).

Ports: MindSpore's scheduler listens on ``--master-port`` (msrun's ``--master_port``);
mindft's controller on ``MS_TFT_PORT`` when set (where MindSpore's own fault-tolerance
controller listens under msrun), else on ``--master-port`` + 1.

Exit codes (:mod:`mindft.exitcodes`, combined by :func:`job_exit_code`): 0 every rank
finished; 3 every rank wrote its dying-gasp checkpoint; 4 a rank had to stop but could
not write its checkpoint; 1 the job failed otherwise (or the crash code of a rank, 128+N
after signal N); 2 bad usage or configuration, nothing started; 130/143 interrupted.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import click

from mindft.channel import Client, ControllerUnreachable
from mindft.config import MINDX_TASK_VARIABLE, TFT_VARIABLE, ConfigError, MindftConfig, load_config
from mindft.exitcodes import ExitCode, describe
from mindft.keys import generate_keys, load_keys
from mindft.launch_plan import (DEFAULT_CLUSTER_TIME_OUT, DEFAULT_GRACE_PERIOD, DEFAULT_PROGRESS_INTERVAL, LaunchSpec,
                                UsageError, mindio_gate_address, plan_launch, rank_environment)
from mindft.protocol import Message, NodeLost, ProcessExit, StatusReply
from mindft.workers import Agent, Console, Scheduler, agent_memory, agent_memory_report

log = logging.getLogger(__name__)

JOB_FILE = "job.json"

# How long the launcher waits for things it does not control; named here, documented in the README.
DUMP_GRACE_PERIOD = 60.0        # after the controller finished, for ranks to dump and exit
CONTROLLER_FINISH_TIMEOUT = 15.0  # after the last rank exited, for the controller's verdict
CLIENT_TIMEOUT = 5.0            # one request/reply with the controller
MONITOR_INTERVAL = 0.1
HANG_CHECK_INTERVAL = 1.0       # how often the launcher asks the controller about hung ranks
HUNG_STATES = ("hung", "dead", "hang")
WATCHER_RESTART_DELAY = 1.0     # before a dead reset-file watcher is started again
WATCHER_MAX_RESTARTS = 10       # then the job fails: device faults would go unseen
SCHEDULER_EXIT_GRACE = 30.0     # after this node's ranks finished, for the scheduler to finish on its own
TAKE_OVER_TIMEOUT = 2.0         # a node agent other than node 0's asks once whether the job already runs
REPLICA_FETCH_TIMEOUT = 120.0   # for the agent that replaces a lost node to fetch one rank's replica


def unprotected_notice(tft_value: str) -> str:
    """The one line that says a job runs without fault tolerance and how to turn it on."""
    why = (f"{TFT_VARIABLE}={tft_value!r} enables no option" if tft_value.strip()
           else f"{TFT_VARIABLE} is not set")
    return (f"fault tolerance is OFF ({why}): the ranks train unprotected, with no controller and no "
            f"restarts; turn it on with e.g. {TFT_VARIABLE}='{{RSC:1}}'")


# What each waiting state waits for: the timeout that bounds it, and the rank states that are done.
_WAITS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "PAUSING": ("pause", ("paused", "faulty", "dead", "done"), "to pause"),
    "REPAIRING": ("repair", ("paused", "restored", "resumed", "running", "done", "registered"),
                  "to be repaired"),
    "ROLLBACK": ("rollback", ("restored", "done"), "to restore"),
    "RESUMING": ("resume", ("resumed", "done"), "to resume"),
}


def recovery_progress(status: StatusReply, seconds_in_state: float, timeouts: Any) -> Optional[str]:
    """One progress line while a recovery waits (state, who is waited on, time left); None otherwise."""
    wait = _WAITS.get(status.state)
    if wait is None:
        return None
    name, done, verb = wait
    pending = []
    for row in status.ranks:
        if row.state in done:
            continue
        if status.state == "REPAIRING":
            back = row.state == "dead" or row.order == "start"  # off its device: started once the device is back
            why = "process not back" if back else "device not recovered"
            if row.state == "lost":
                why = "its node was lost; waiting for the node that replaces it"
            pending.append(f"rank {row.rank} ({why})")
        else:
            pending.append(f"rank {row.rank}")
    left = max(0.0, getattr(timeouts, name) - seconds_in_state)
    who = f"waiting for {', '.join(pending)} {verb}" if pending else "waiting"
    faults = f"; faults: {status.reason}" if status.reason else ""
    return (f"recovery round {status.round}: {status.state} for {seconds_in_state:.0f}s, {who}; "
            f"{left:.0f}s left (timeouts.{name}){faults}")


def job_verdict(code: int) -> str:
    """The launcher's last line: its exit code and what it means."""
    if 128 < code < 128 + 65:
        try:
            return f"exit code {code}: interrupted by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    meaning = describe(code)
    return f"exit code {code}" if meaning == f"exit code {code}" else f"exit code {code}: {meaning}"


def describe_exit(code: int) -> str:
    """A rank's exit status for people, in the words of :func:`mindft.exitcodes.describe`."""
    if code < 0:
        return describe(code)
    meaning = describe(code)
    return f"exit {code}" if meaning == f"exit code {code}" else f"exit {code} ({meaning})"


_STOPPED_ON_PURPOSE = (ExitCode.DUMPED, ExitCode.DUMP_FAILED)


def job_exit_code(controller_code: Optional[int], final_codes: Iterable[Optional[int]]) -> int:
    """Combine the controller's verdict and the ranks' final exit codes into the launcher's.

    A checkpoint is claimed (3) only when every rank says it wrote one; a rank that could
    not write its own makes the job 4; a crashed rank's code (128+N after signal N) wins
    over a controller that merely agrees the job failed.
    """
    codes = [c for c in final_codes if c is not None]
    if ExitCode.DUMP_FAILED in codes:
        return ExitCode.DUMP_FAILED
    if codes and all(c == ExitCode.DUMPED for c in codes):
        return ExitCode.DUMPED
    if controller_code not in (None, ExitCode.OK):
        return controller_code
    crashed = [c for c in codes if c != ExitCode.OK and c not in _STOPPED_ON_PURPOSE]
    if crashed:
        code = crashed[0]
        return 128 - code if code < 0 else code
    if ExitCode.DUMPED in codes:
        return ExitCode.DUMPED
    return ExitCode.OK


def start_replication(spec: LaunchSpec, keys: Any) -> Optional[Any]:
    """This node agent's replica keeper and sender (mindft.replication) when the job needs them:
    several nodes, mindft's own backend, MINDFT_AGENT_REPLICATION not 0; else None."""
    if not spec.protected or spec.mindio or spec.nnodes < 2 or spec.state_dir is None:
        return None
    config = load_config(spec.env)
    if not config.agent_replication:
        return None
    from mindft.replica import NodeReplication, replica_spill

    return NodeReplication(spec.state_dir, spec.local_ranks, spec.nproc, spec.nnodes, spec.node_rank,
                           spec.master_ip, spec.controller_address, keys,
                           spill=replica_spill(config.dump_dir, f"node{spec.node_rank}"))


class _ControllerRunner:
    """The controller and the reset watcher, in threads of the launcher (node 0 only).

    Everything crosses in-process through the controller's thread-safe calls
    (``on_process_exit``, ``on_device_event``, ``latest_status``); a thread that dies
    is noticed here: the watcher is restarted, a dead controller fails the job.
    """

    def __init__(self, config: MindftConfig, controller_class: Optional[type] = None,
                 on_kill: Optional[Any] = None, on_start: Optional[Any] = None) -> None:
        from mindft.controller import Controller  # imported late: only node 0 needs it
        from mindft.resetwatch import ResetWatcher

        self.config = config
        # Binds now: port 0 becomes a real port. The callbacks run on the controller's thread.
        self.controller = (controller_class or Controller)(config, on_kill=on_kill, on_start=on_start)
        self.port = int(self.controller.endpoint.rsplit(":", 1)[1])
        self.result: Optional[Any] = None
        self.watcher = ResetWatcher(config.reset_file, config.timeouts.reset_poll_interval)
        self.watching = False
        self.watcher_restarts = 0
        self._watcher_died_at: Optional[float] = None
        self._watch_stop = threading.Event()
        self._watch_thread: Optional[threading.Thread] = None
        self._controller_thread: Optional[threading.Thread] = None
        self.stopping = False

    def start(self) -> None:
        self._controller_thread = self.controller.start()

    def status(self) -> StatusReply:
        """The controller's last published status (no socket, no read of its thread's state)."""
        return self.controller.latest_status()

    def poll(self) -> Optional[Any]:
        """The controller's result once it finished; a controller thread that died counts as a failure."""
        if self.result is None and self._controller_thread is not None:
            result = self.controller.join(0)
            if result is not None:
                self.result = result
            elif not self._controller_thread.is_alive():
                log.error("the controller thread died without a result (its traceback is above); "
                          "failing the job")
                self.result = _Result(ExitCode.FAILED, "the controller thread died")
        return self.result

    @property
    def finished(self) -> bool:
        return self.poll() is not None

    def start_watcher_when_training(self) -> None:
        """Start the reset watcher once every rank registered.

        The controller ignores device events for ranks it does not know yet, so a fault
        already in the file at start is read only when it can be acted on.
        """
        if self.watching or self.finished or self.status().state == "STARTING":
            return
        self.watching = True
        self._start_watch_thread()
        log.info("watching the device plugin's reset file %s every %gs", self.config.reset_file,
                 self.config.timeouts.reset_poll_interval)

    def _start_watch_thread(self) -> None:
        self._watch_thread = threading.Thread(target=self._watch, name="mindft-resetwatch", daemon=True)
        self._watch_thread.start()

    def _watch(self) -> None:
        try:
            self.watcher.run(self._on_reset_event, self._watch_stop)
        except BaseException:
            log.exception("the reset-file watcher died")
            raise

    def _on_reset_event(self, event: Any) -> None:
        from mindft.resetwatch import flow_inputs
        for item in flow_inputs(event):
            self.controller.on_device_event(item)

    def check_watcher(self) -> Optional[str]:
        """Restart a watcher thread that died; the reason to fail the job once it died too often."""
        thread = self._watch_thread
        if thread is None or thread.is_alive() or self._watch_stop.is_set():
            return None
        now = time.monotonic()
        if self._watcher_died_at is None:
            self._watcher_died_at = now
            log.error("the reset-file watcher thread died: device faults are not seen until it is "
                      "restarted (in %gs, restart %d/%d)", WATCHER_RESTART_DELAY, self.watcher_restarts + 1,
                      WATCHER_MAX_RESTARTS)
        if self.watcher_restarts >= WATCHER_MAX_RESTARTS:
            return (f"the reset-file watcher died {self.watcher_restarts + 1} times; device faults "
                    f"in {self.config.reset_file} can no longer be seen")
        if now - self._watcher_died_at < WATCHER_RESTART_DELAY:
            return None
        self.watcher_restarts += 1
        self._watcher_died_at = None
        log.warning("restarting the reset-file watcher (restart %d/%d)", self.watcher_restarts,
                    WATCHER_MAX_RESTARTS)
        self._start_watch_thread()
        return None

    def stop(self) -> None:
        self.stopping = True
        self._watch_stop.set()
        if self._watch_thread is not None:
            self._watch_thread.join(self.config.timeouts.reset_poll_interval + 5.0)
        if self.poll() is None:
            # The job did not end in the controller (a signal, a launcher-side failure): its own
            # "finished: exit code 1" would contradict the launcher's verdict, printed last.
            controller_log = logging.getLogger("mindft.controller")
            level = controller_log.level
            controller_log.setLevel(logging.WARNING)
            try:
                self.controller.stop(10.0)
            finally:
                controller_log.setLevel(level)
            self.poll()
            log.info("controller stopped by the launcher")


@dataclass(frozen=True)
class _Result:
    exit_code: int
    reason: str


class Launcher:
    """Run one node of a job to completion and return its exit code."""

    def __init__(self, spec: LaunchSpec, console: Optional[Console] = None) -> None:
        self.spec = spec
        self.console = console or Console(prefix=spec.prefix_output)
        self.agent = Agent(spec, self.console)
        self.keys = None if spec.insecure or not spec.protected else load_keys(spec.key_file)
        self._connect()
        self.runner: Optional[_ControllerRunner] = None
        self.mindio_host: Optional[Any] = None
        self.replication: Optional[Any] = None  # mindft.replication.NodeReplication
        self.scheduler: Optional[Scheduler] = Scheduler(spec) if spec.runs_scheduler else None
        self._signal: Optional[int] = None
        self._last_status: Optional[StatusReply] = None  # other nodes: the controller's, polled
        self._orders: queue.SimpleQueue[tuple[str, int, int, bool, str]] = queue.SimpleQueue()
        self._signals_seen = 0
        self._last_hang_check = 0.0
        self._unprotected_failure: Optional[int] = None  # the first failed rank's exit code
        self._failure: Optional[str] = None  # why the launcher itself fails the job
        self._progress_key: Optional[tuple[str, int]] = None
        self._progress_since = 0.0
        self._progress_last = 0.0

    def _connect(self) -> None:
        self.client = Client(self.spec.controller_address, self.keys)
        # Polled from the monitor loop: a slow answer must not delay restarts or signals.
        self._status_client = Client(self.spec.controller_address, self.keys,
                                               timeout=HANG_CHECK_INTERVAL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals_seen += 1
        if self._signal is None:
            self._signal = signum
        if self._signals_seen > 1:
            # A second Ctrl-C: do not wait for the grace period.
            self.agent.signal_workers(self.agent.workers, signal.SIGKILL)

    def controller_config(self) -> MindftConfig:
        """The controller's configuration: the environment, with the launcher's address and keys."""
        env = rank_environment(self.spec, self.spec.local_ranks[0], 0)
        env.update({"MS_NODE_ID": "0", "RANK_ID": "0", "MS_TFT_PORT": str(self.spec.controller_port or 29600)})
        config = load_config(env)
        # Port 0 (not a valid MS_TFT_PORT) lets the controller bind a free port itself.
        return dataclasses.replace(config, controller_port=self.spec.controller_port)

    def write_job_file(self) -> None:
        """``run_dir/job.json``: what ``mindft status --job`` and the demo need to find the job."""
        info = {"controller": self.spec.controller_address,
                "key_file": None if self.spec.insecure else str(self.spec.key_file),
                "insecure": self.spec.insecure,
                "reset_file": self.spec.env.get("MINDFT_RESET_FILE", ""),
                "world_size": self.spec.world_size, "node_rank": self.spec.node_rank,
                "scheduler": self.scheduler.address if self.scheduler is not None else None,
                "scheduler_pid": self.scheduler.pid if self.scheduler is not None else None,
                "launcher_pid": os.getpid(), "log_dir": str(self.spec.log_dir),
                "ranks": {str(r): pid for r, pid in self.agent.pids().items()}}
        path = self.spec.run_dir / JOB_FILE
        temporary = path.with_name(f".{JOB_FILE}.{os.getpid()}")
        temporary.write_text(json.dumps(info, indent=2))
        os.replace(temporary, path)

    def _notify(self, message: Message, what: str) -> None:
        """Send ``message`` to the controller from a helper thread: the monitor loop never blocks on it."""
        if self.spec.mindio:
            return  # MindIO's controller notices a lost rank by its heartbeats
        def send() -> None:
            try:
                self.client.request(message)
            except ControllerUnreachable as error:
                log.warning("could not tell the controller that %s: %s", what, error)

        threading.Thread(target=send, name="mindft-notify", daemon=True).start()

    def _before_start(self) -> bool:
        """True on node 0 while the controller still waits for every rank to register."""
        return (self.runner is not None and not self.runner.finished
                and self.runner.status().state == "STARTING")

    def _abort(self, reason: str) -> None:
        """Fail the job from the launcher: the supervise loop stops every rank and exits 1."""
        if self._failure is None:
            self._failure = reason
            self.console.line("mindft-launch", f"job failed: {reason}")

    def _job_over(self) -> bool:
        """True on node 0 once the controller reached DONE or FAILED (other nodes cannot know)."""
        return self.runner is not None and (
            self.runner.finished or self.runner.status().state in ("DONE", "FAILED"))

    def _report_exit(self, rank: int, code: int, pid: int) -> None:
        """Tell the controller a rank's process exited and will be restarted."""
        if self.runner is not None:
            self.runner.controller.on_process_exit(rank, code, pid)
        else:
            self._notify(ProcessExit(rank=rank, returncode=code, pid=pid), f"rank {rank} exited")

    def _report_lost(self, rank: int, code: int, pid: int, reason: str) -> None:
        """Tell the controller a rank will not come back: the job fails now, the healthy ranks dump."""
        if self.runner is not None:
            self.runner.controller.on_process_exit(rank, code, pid, final=True)
        else:
            self._notify(ProcessExit(rank=rank, returncode=code, pid=pid, will_restart=False),
                         f"rank {rank} is lost")

    def _poll_orders(self) -> None:
        """Nodes other than 0 learn the controller's kills and starts from its status: a hung
        rank (killed so it can restart), and the ``order`` of each row on this node. On node 0
        the same orders arrive in-process (:meth:`_follow_orders`)."""
        if not self.spec.protected or self.spec.mindio or self.runner is not None:
            return
        now = time.monotonic()
        if now - self._last_hang_check < HANG_CHECK_INTERVAL:
            return
        self._last_hang_check = now
        try:
            status = self._last_status = self._status_client.status()
        except ControllerUnreachable:
            return
        pids = self.agent.pids()
        for row in status.ranks:
            worker = self.agent.workers.get(row.rank)
            if worker is None:
                continue
            if row.order == "kill" and row.pid == pids.get(row.rank):
                self._orders.put(("kill", row.rank, row.pid, False, "the controller stops it for the recovery"))
            elif row.order == "start" and worker.awaiting_start and worker.pid is None:
                self._orders.put(("start", row.rank, 0, False, "the controller starts it for the recovery"))
            elif row.rank in pids and row.pid == pids[row.rank] and row.state.lower() in HUNG_STATES:
                log.warning("controller reports rank %d (pid %d) %s; killing it so it can restart",
                            row.rank, row.pid, row.state)
                self.agent.signal_workers([row.rank], signal.SIGKILL)

    def _follow_orders(self) -> None:
        """Kill and start ranks as node 0's controller decided (queued from its thread)."""
        while True:
            try:
                order, rank, pid, restart, why = self._orders.get_nowait()
            except queue.Empty:
                return
            worker = self.agent.workers.get(rank)
            if worker is None:
                log.warning("the controller asked to %s rank %d, which runs on another node: its "
                            "launcher must do it", order, rank)
            elif order == "kill" and worker.pid is not None and (not pid or pid == worker.pid):
                worker.awaiting_start = worker.awaiting_start or not restart
                then = "so it can restart" if restart else "(it starts again when the controller says)"
                self.console.line("mindft-launch", f"controller: rank {rank} (pid {worker.pid}): {why}; "
                                                   f"killing it {then}")
                self.agent.signal_workers([rank], signal.SIGKILL)
            elif order == "start" and worker.pid is None and not worker.final and self._signal is None:
                if worker.crashes > self.spec.max_restarts:
                    worker.awaiting_start, worker.final = False, True
                    self._report_lost(rank, worker.returncode or ExitCode.FAILED, 0,
                                      f"rank {rank} crashed {worker.crashes} times (--max-restarts "
                                      f"{self.spec.max_restarts})")
                    continue
                self._renew_cluster()
                worker.awaiting_start = False
                worker.restarts += 1
                self.console.line("mindft-launch", f"controller: {why}: starting rank {rank} "
                                                   f"(restart {worker.restarts}/{self.spec.max_restarts})")
                self.agent.start_worker_list([rank])
                self.write_job_file()

    def _restart_all(self) -> bool:
        """True when the controller restarts every worker after a lost process (it starts them):
        MINDFT_RESTART_SCOPE, else what the ranks said when they registered (their collectives)."""
        scope = self.spec.env.get("MINDFT_RESTART_SCOPE", "").strip()
        if scope in ("all", "rank"):
            return scope == "all"
        status = self.runner.status() if self.runner is not None else self._last_status
        return status is not None and status.restart_all

    def _renew_cluster(self) -> None:
        """Before the first worker of a restart of every worker: a new MindSpore scheduler, as
        the workers that come back cannot join the old cluster (MCCL on CPU)."""
        scheduler = self.scheduler
        if scheduler is None or scheduler.serves_workers or not self._restart_all() or self.agent.running():
            return
        scheduler.exit_seen = True  # stopping it is no failure
        scheduler.stop(0.0, 0.0)
        scheduler.exit_seen = False
        scheduler.start()

    def _handle_exits(self) -> None:
        for rank, code in self.agent.monitor().items():
            worker = self.agent.workers[rank]
            if code is None or worker.final or worker.process is None:
                continue  # running, gone for good, or waiting for the controller to start it
            pid = worker.process.pid
            self.console.line("mindft-launch", f"rank {rank} (pid {pid}) {describe_exit(code)}")
            if code == ExitCode.OK or self._signal is not None:
                worker.final = True
                continue
            if not self.spec.protected:
                # Nothing can restore an unprotected rank: stop the job as msrun does.
                worker.final = True
                if self._unprotected_failure is None:
                    self._unprotected_failure = code
                continue
            if self.scheduler is not None:
                self.scheduler.serves_workers = False  # the cluster lost a worker for good
            if code == ExitCode.LEFT_DEVICE or worker.awaiting_start:
                # Left its device for a hot reset, or killed so every worker restarts: the
                # controller starts it again (when its device is back, with every worker).
                worker.awaiting_start = True
                self.console.line("mindft-launch", f"rank {rank} " + (
                    "left its device for a hot reset" if code == ExitCode.LEFT_DEVICE else "stopped")
                    + "; it starts again when the controller says")
                self._report_exit(rank, code, pid)
                worker.returncode, worker.process = code, None
                continue
            if code in _STOPPED_ON_PURPOSE:
                worker.final = True
                if self.runner is not None and not self._job_over():
                    # It gave up on its own (not on the controller's order): fail now, not after
                    # timeouts.repair, so the other ranks dump while their state is fresh.
                    self._report_lost(rank, code, pid, f"rank {rank} stopped: {describe(code)}")
                continue
            if self._before_start():
                # A rank that dies before every rank registered fails the same way again
                # (a bad script, a missing module): restarting it only hides the error.
                worker.final = True
                self._abort(f"rank {rank} {describe_exit(code)} before the job started; not restarting "
                            f"it: see {worker.log_path}")
                continue
            job_over = self._job_over()
            if self._restart_all() and not job_over:
                # Its peers cannot go on without it: the controller restarts every worker together.
                worker.awaiting_start = True
                worker.crashes += 1
                self._report_exit(rank, code, pid)
                worker.returncode, worker.process = code, None
                continue
            if not job_over:
                self._report_exit(rank, code, pid)
            if worker.restarts >= self.spec.max_restarts or job_over:
                worker.final = True
                why = "the job is over" if job_over else f"it used all {self.spec.max_restarts} restarts"
                self.console.line("mindft-launch", f"not restarting rank {rank}: {why}")
                if not job_over:
                    # Fail the job now instead of after timeouts.repair: the healthy ranks dump.
                    self._report_lost(rank, code, pid, f"rank {rank} {describe_exit(code)} and used "
                                                       f"all {self.spec.max_restarts} restarts")
                continue
            worker.restarts += 1
            # Whether the new process finds its state (a peer replica) is the rank's to say.
            self.console.line("mindft-launch", f"restarting rank {rank} "
                              f"(restart {worker.restarts}/{self.spec.max_restarts})")
            self.agent.start_worker_list([rank])
            self.write_job_file()

    def run(self) -> int:
        """Start everything, supervise until the job ends, stop everything; the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        spec = self.spec
        if not spec.protected:
            self.console.line("mindft-launch", unprotected_notice(spec.env.get(TFT_VARIABLE, "")))
        elif spec.mindio:
            self._start_mindio()
        elif spec.node_rank == 0:
            self.runner = _ControllerRunner(self.controller_config(),
                                            on_kill=lambda rank, pid, why, restart: self._orders.put(
                                                ("kill", rank, pid, restart, why)),
                                            on_start=lambda rank, why: self._orders.put(("start", rank, 0, False, why)))
            if spec.controller_port == 0:
                # The controller picked a free port; every rank and client must use it.
                spec = self.spec = dataclasses.replace(spec, controller_port=self.runner.port)
                self.agent.spec = spec
                self._connect()
            self.runner.start()
        controller = (f"controller {spec.controller_address}{' (INSECURE)' if spec.insecure else ''}"
                      if spec.protected else "no controller")
        if spec.scheduler_port is None:
            cluster = "no MindSpore scheduler"
        else:
            host = f"[{spec.master_ip}]" if ":" in spec.master_ip else spec.master_ip
            cluster = f"MindSpore scheduler {host}:{spec.scheduler_port}"
        if spec.mindio:
            controller = (f"MindIO TFT controller {spec.master_ip}:{spec.controller_port} (its TCP is not "
                          f"encrypted), step gate {mindio_gate_address(spec)}")
        self.console.line("mindft-launch", f"{spec.world_size} rank(s), {spec.nproc} on this node "
                          f"(node {spec.node_rank}/{spec.nnodes}); {controller}; {cluster}; run directory "
                          f"{spec.run_dir}, logs in {spec.log_dir}")
        code: Optional[int] = None
        try:
            if spec.protected:
                spec = self.spec = self.agent.spec = dataclasses.replace(spec, state_dir=agent_memory())
                log.info("the ranks' snapshots live in %s (shared memory held for the job)", spec.state_dir)
                self.replication = start_replication(spec, self.keys)
                if self.replication is not None:
                    spec = self.spec = self.agent.spec = dataclasses.replace(
                        spec, replica_endpoint=self.replication.endpoint)
            if self.scheduler is not None:
                self.scheduler.start()  # first, as msrun: workers connect to it from init()
            if not self._take_over_lost_node():
                self.agent.start_all_workers()
            self.write_job_file()
            code = self._supervise()
        finally:
            running = self.agent.running()
            if running:
                self.agent.kill_worker(running, signal.SIGTERM, spec.grace_period)
            if self.scheduler is not None:
                # After a clean end it exits by itself once every worker unregistered.
                self._stop_scheduler(clean_end=code == ExitCode.OK)
            if self.runner is not None:
                self.runner.stop()
            if self.mindio_host is not None:
                self.mindio_host.stop()  # after the ranks (after a clean end the controller is gone already)
            for worker in self.agent.workers.values():
                if worker.pump is not None:
                    worker.pump.join(2.0)
            if self.replication is not None:
                self.replication.close()
                self.console.line("mindft-launch", self.replication.summary())
            if self.spec.state_dir is not None:
                self.console.line("mindft-launch", agent_memory_report(self.spec.state_dir))
                shutil.rmtree(self.spec.state_dir, ignore_errors=True)
        return code

    def _take_over_lost_node(self) -> bool:
        """On a node other than 0: when the job already runs with this node's ranks (this agent
        replaces a lost node, or started again without its memory), restore their replicas from
        the next node's keeper into this node's memory, tell the controller the node was lost
        (:class:`~mindft.protocol.NodeLost`, with the steps restored: the only ones those ranks
        can roll back to) and start them as new incarnations, now or, when every worker restarts
        together, on the controller's order. False (nothing done) for a job that is starting."""
        spec = self.spec
        if spec.node_rank == 0 or not spec.protected or spec.mindio:
            return False
        try:
            status = Client(spec.controller_address, self.keys, timeout=TAKE_OVER_TIMEOUT).status()
        except ControllerUnreachable:
            return False  # node 0 is not up yet: the job is starting
        rows = {row.rank: row for row in status.ranks}
        local = list(spec.local_ranks)
        if status.state in ("STARTING", "DONE", "FAILED") or not any(rank in rows for rank in local):
            return False
        self.console.line("mindft-launch", f"the job already runs ({status.state}, every rank finished step "
                                           f"{status.step}): this node replaces node {spec.node_rank}, lost with "
                                           f"rank(s) {local} and their snapshots")
        steps = self._restore_replicas(rows)
        previous = (spec.node_rank - 1) % spec.nnodes
        report = NodeLost(node=spec.node_rank, ranks=tuple(local), steps=tuple(steps[rank] for rank in local),
                          replicas_of=tuple(range(previous * spec.nproc, (previous + 1) * spec.nproc)),
                          reason=f"a new agent for node {spec.node_rank} started without its ranks' snapshots")
        try:
            answer = self.client.request(report)
        except ControllerUnreachable as error:
            self.console.line("mindft-launch", f"could not tell the controller that node {spec.node_rank} was "
                                               f"lost ({error}); starting its ranks as new incarnations")
        else:
            self.console.line("mindft-launch", f"controller: {answer.detail}")
            try:
                status = self.client.status()
            except ControllerUnreachable:  # it answered, then ended the job and left
                status = dataclasses.replace(status, state="FAILED",
                                             reason=answer.detail.removeprefix("the job failed: "))
        for rank in local:  # new incarnations (a start on the controller's order counts one more)
            row = rows.get(rank)
            self.agent.workers[rank].restarts = (row.incarnation if row is not None else 0) + (not status.restart_all)
        if status.state in ("DONE", "FAILED"):
            self._abort(f"the job ended before this node's ranks could rejoin it: {status.reason}")
            for worker in self.agent.workers.values():
                worker.final = True
        elif status.restart_all:
            for worker in self.agent.workers.values():
                worker.awaiting_start = True  # every worker starts together, when the controller says
            self.console.line("mindft-launch", f"rank(s) {local} start with every worker, when the controller says")
        else:
            self.agent.start_worker_list(local)
        return True

    def _restore_replicas(self, rows: Mapping[int, Any]) -> dict[int, int]:
        """Fetch each local rank's replica from the next node's keeper into this node's memory;
        rank → the step restored (-1: none)."""
        from mindft.replica import fetch_replica
        from mindft.snapshot import SnapshotError, SnapshotStore

        spec = self.spec
        steps = {rank: -1 for rank in spec.local_ranks}
        if self.replication is None or spec.state_dir is None:
            self.console.line("mindft-launch", "no replica to restore: the node agents do not replicate "
                                               "(MINDFT_AGENT_REPLICATION=0)")
            return steps
        buddy = (spec.node_rank + 1) % spec.nnodes
        keeper = next((row.replica_endpoint for rank, row in sorted(rows.items())
                       if rank // spec.nproc == buddy and row.replica_endpoint.startswith("tcp://")), "")
        if not keeper:
            self.console.line("mindft-launch", f"no replica to restore: the controller knows no keeper on node {buddy}")
            return steps
        for rank in spec.local_ranks:
            try:
                snapshot = fetch_replica(keeper, rank, self.keys, REPLICA_FETCH_TIMEOUT)
                with SnapshotStore(home=spec.state_dir / f"rank{rank}") as store:
                    store.adopt(snapshot)
            except SnapshotError as error:
                self.console.line("mindft-launch", f"rank {rank}: no replica restored from the keeper at {keeper}: "
                                                   f"{error}")
                continue
            steps[rank] = snapshot.step
            self.console.line("mindft-launch", f"restored rank {rank}'s replica of step {snapshot.step} from the "
                                               f"keeper at {keeper} into this node's memory")
        return steps

    def _start_mindio(self) -> None:
        """Node 0 runs MindIO's controller and the step gate, unless MindCluster runs the controller."""
        from mindft.mindio import MindioHost, controller_runs_here

        spec = self.spec
        if not controller_runs_here(spec.node_rank, spec.env):
            log.info("%s is set: MindCluster runs MindIO's controller; no step gate", MINDX_TASK_VARIABLE)
            return
        config = self.controller_config()
        timeouts = config.timeouts

        def alive(rank: int) -> bool:
            worker = self.agent.workers.get(rank)
            return worker is not None and worker.pid is not None

        # node 0 plays MindCluster's MindX for MindIO's controller: the reset file's hot resets go
        # through MindIO's ARF; kills and restarts are queued as the controller's orders are.
        standin = dict(kill=lambda rank, why: self._orders.put(("kill", rank, 0, False, why)),
                       start=lambda rank, why: self._orders.put(("start", rank, 0, False, why)),
                       alive=alive, leave_timeout=timeouts.leave, gather_timeout=timeouts.pause,
                       repair_timeout=timeouts.repair)
        self.mindio_host = MindioHost(spec.world_size, spec.master_ip, spec.controller_port, self.keys,
                                      gate_port=spec.controller_port + 1, reset_file=config.reset_file,
                                      poll_interval=timeouts.reset_poll_interval, standin=standin)
        self.mindio_host.start()

    def _supervise(self) -> int:
        spec = self.spec
        controller_done_at: Optional[float] = None
        all_exited_at: Optional[float] = None
        while True:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                self.console.line("mindft-launch", f"{name}: stopping every rank "
                                  f"(grace period {spec.grace_period:g}s, then SIGKILL)")
                self.agent.kill_worker(self.agent.running(), self._signal, spec.grace_period)
                return 128 + self._signal
            self._follow_orders()
            self._handle_exits()
            self._check_scheduler()
            running = self.agent.running()
            if self._failure is None and not running and self._before_start() and all(
                    w.final for w in self.agent.workers.values()):
                self._abort("every rank exited before registering with the controller: does the "
                            "script use mindft (mindft.mindspore.train, FaultTolerantLoop)?")
            if self._failure is not None:
                if running:
                    self.agent.kill_worker(running, signal.SIGTERM, spec.grace_period)
                return job_exit_code(ExitCode.FAILED, self._final_codes())
            if self._unprotected_failure is not None and running:
                self.console.line("mindft-launch", f"stopping rank(s) {running}: a rank failed and fault "
                                  f"tolerance is off")
                self.agent.kill_worker(running, signal.SIGTERM, spec.grace_period)
                running = []
            if self.runner is not None:
                self.runner.start_watcher_when_training()
                watcher_failure = self.runner.check_watcher()
                if watcher_failure is not None:
                    self._abort(watcher_failure)
                    continue
                if self.runner.finished and controller_done_at is None:
                    controller_done_at = time.monotonic()
                if controller_done_at is not None:
                    if not running:
                        return job_exit_code(self.runner.result.exit_code, self._final_codes())
                    if time.monotonic() - controller_done_at > DUMP_GRACE_PERIOD:
                        log.warning("rank(s) %s still running %gs after the controller finished; "
                                    "stopping them", running, DUMP_GRACE_PERIOD)
                        self.agent.kill_worker(running, signal.SIGTERM, spec.grace_period)
                        return job_exit_code(self.runner.result.exit_code, self._final_codes())
                elif not running and all(w.final for w in self.agent.workers.values()):
                    # Every rank is gone: the controller's verdict should follow at once.
                    all_exited_at = all_exited_at or time.monotonic()
                    if time.monotonic() - all_exited_at > CONTROLLER_FINISH_TIMEOUT:
                        log.warning("every rank exited but the controller has no result after %gs",
                                    CONTROLLER_FINISH_TIMEOUT)
                        return job_exit_code(None, self._final_codes()) or ExitCode.FAILED
                self._report_progress()
            elif self.mindio_host is not None and self._mindio_over(running):
                return job_exit_code(None, self._final_codes())
            elif not running and all(w.final for w in self.agent.workers.values()):
                if self._unprotected_failure is not None:
                    return job_exit_code(None, [self._unprotected_failure])
                return job_exit_code(None, self._final_codes())
            else:
                self._poll_orders()  # also while every local rank waits to be started
            time.sleep(MONITOR_INTERVAL)

    def _mindio_over(self, running: Sequence[int]) -> bool:
        """On MindIO: watch the reset watcher; True once no rank runs and none will start again."""
        host = self.mindio_host
        failure = host.check(WATCHER_MAX_RESTARTS)
        if failure is not None:
            self._abort(failure)
        if running:
            return False
        workers = self.agent.workers.values()
        off = [w for w in workers if w.awaiting_start and not w.final]
        if not off:
            return all(w.final for w in workers)
        # Ranks off their chip come back on 'recovered' (the stand-in starts them) unless the job failed.
        return host.standin is not None and host.standin.failed is not None

    def _check_scheduler(self) -> None:
        """A scheduler that fails while ranks still need it fails the job at once, loudly."""
        scheduler = self.scheduler
        if scheduler is None or scheduler.exit_seen:
            return
        code = scheduler.poll()
        if code is None:
            return
        scheduler.exit_seen = True
        if code == ExitCode.OK or all(w.final for w in self.agent.workers.values()):
            log.info("MindSpore's scheduler (pid %d) %s", scheduler.pid, describe_exit(code))
            return
        why = scheduler.last_error()
        hint = ("; a script that never calls mindspore.communication.init() runs with --no-scheduler"
                if "timed out" in why or "not successfully spawned" in why else "")
        self._abort(f"MindSpore's scheduler (pid {scheduler.pid}) {describe_exit(code)}: the ranks cannot "
                    f"communicate without it ({why or 'no error line in its log'}); see "
                    f"{scheduler.log_path}{hint}")

    def _stop_scheduler(self, clean_end: bool) -> None:
        """Stop the scheduler; after a clean end first let it see every worker unregister.

        Ranks on other nodes may still be unregistering when this node's ranks are done,
        as under msrun, which waits for its scheduler. A scheduler no worker ever joined
        (a script that never calls init()) would wait for nothing: it is stopped at once.
        """
        scheduler = self.scheduler
        assert scheduler is not None
        wait = SCHEDULER_EXIT_GRACE if clean_end and scheduler.cluster_formed() else 0.0
        code = scheduler.stop(wait, self.spec.grace_period)
        if wait and code != ExitCode.OK and not scheduler.exit_seen:
            log.warning("MindSpore's scheduler (pid %d) %s after the job ended; see %s",
                        scheduler.pid, describe_exit(code) if code is not None else "did not stop",
                        scheduler.log_path)

    def _report_progress(self) -> None:
        """While a recovery waits, say so at a steady pace (the controller logs only transitions)."""
        assert self.runner is not None
        status = self.runner.status()
        now = time.monotonic()
        key = (status.state, status.round)
        if key != self._progress_key:
            self._progress_key, self._progress_since, self._progress_last = key, now, now
            return
        if now - self._progress_last < self.spec.progress_interval:
            return
        self._progress_last = now
        line = recovery_progress(status, now - self._progress_since, self.runner.config.timeouts)
        if line is not None:
            self.console.line("mindft-launch", line)

    def _final_codes(self) -> list[Optional[int]]:
        self._dump_for_ranks_without_process()
        return [w.returncode for w in self.agent.workers.values()]

    def _dump_for_ranks_without_process(self) -> None:
        """The job failed while ranks had no process (off their devices for a hot reset that
        failed, or stopped so every worker restarts): their snapshots are in this agent's memory,
        so the agent writes their dying-gasp checkpoints."""
        from mindft.snapshot import SnapshotError, SnapshotStore

        for rank, worker in self.agent.workers.items():
            if not worker.awaiting_start or worker.pid is not None or self.spec.state_dir is None:
                continue
            worker.awaiting_start, worker.final = False, True
            config = load_config(rank_environment(self.spec, rank, worker.restarts))
            step = getattr(getattr(self.runner, "controller", None), "job", None)
            step = getattr(step, "dump_step", -1) if step is not None else -1
            try:
                with SnapshotStore(home=self.spec.state_dir / f"rank{rank}", resume=True) as store:
                    path = store.dump(config.dump_dir, rank, config.world_size, step)
            except SnapshotError as error:
                worker.returncode = ExitCode.DUMP_FAILED
                self.console.line("mindft-launch", f"rank {rank} had no process; its dying-gasp checkpoint "
                                                   f"could NOT be written from the agent's memory: {error}")
                continue
            worker.returncode = ExitCode.DUMPED
            self.console.line("mindft-launch", f"rank {rank} had no process; the agent wrote its dying-gasp "
                                               f"checkpoint from memory: {path}")


def _setup_logging(verbose: bool) -> None:
    class _Tagged(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            tag = record.name.rsplit(".", 1)[-1]
            tag = "mindft-launch" if tag in ("launch", "launch_plan", "workers") else tag
            level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
            return f"[{tag}] {level}{record.getMessage()}" + (
                "\n" + self.formatException(record.exc_info) if record.exc_info else "")

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Tagged())
    root = logging.getLogger("mindft")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def _fail(message: str) -> None:
    click.echo(f"mindft-launch: {message}", err=True)
    sys.exit(ExitCode.USAGE)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                 "help_option_names": ["-h", "--help"]})
@click.option("--nproc", "--local_worker_num", "nproc", type=click.IntRange(1, 4096), default=None,
              envvar="MINDFT_NPROC", help="Ranks to start on this node. [default: 1, or --worker_num / --nnodes]")
@click.option("--nnodes", type=click.IntRange(1, 100000), default=None, envvar="MINDFT_NNODES",
              help="Nodes in the job. [default: 1, or --worker_num / --local_worker_num]")
@click.option("--worker_num", "--worker-num", "worker_num", type=click.IntRange(1), default=None,
              help="msrun's name: ranks in the whole job (--nproc x --nnodes).")
@click.option("--node-rank", "--node_rank", "node_rank", type=click.IntRange(-1), default=None,
              envvar=["MINDFT_NODE_RANK", "VC_TASK_INDEX"],
              help="This node's index; node 0 runs the controller and MindSpore's scheduler (-1, msrun's "
                   "default, means 0 on one node). [default: 0; env: MINDFT_NODE_RANK, VC_TASK_INDEX]")
@click.option("--master-addr", "--master_addr", "master_addr", default="127.0.0.1", show_default=True,
              envvar="MINDFT_MASTER_ADDR",
              help="Address of node 0 (IP or host name); the scheduler and the controller listen there.")
@click.option("--master-port", "--master_port", "master_port", type=click.IntRange(0, 65535), default=None,
              envvar="MINDFT_MASTER_PORT",
              help="MindSpore's scheduler port (MS_SCHED_PORT, as msrun's). The controller listens on "
                   "MS_TFT_PORT if set, else on this port + 1. Default: free ports on one node, 29600 on several.")
@click.option("--scheduler/--no-scheduler", default=True, show_default=True, envvar="MINDFT_SCHEDULER",
              help="Run MindSpore's cluster as msrun does (scheduler on node 0, MS_ROLE/MS_SCHED_* in the "
                   "ranks); --no-scheduler for a script that never calls mindspore.communication.init().")
@click.option("--cluster-time-out", "--cluster_time_out", "cluster_time_out", type=int,
              default=DEFAULT_CLUSTER_TIME_OUT, show_default=True,
              help="Seconds for MindSpore's cluster to form (MS_TOPO_TIMEOUT, as msrun's); negative: forever.")
@click.option("--join", type=click.BOOL, default=None,
              help="Accepted for msrun compatibility; mindft-launch always stays with the job.")
@click.option("--max-restarts", type=click.IntRange(0, 1000), default=3, show_default=True,
              help="Times each rank may be restarted after it crashed.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Private directory for the key file, logs and job.json. Default: a new temporary one.")
@click.option("--log-dir", "--log_dir", "log_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Per-rank log files (rank_N.log) and scheduler.log. Default: RUN_DIR/logs.")
@click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              envvar="MINDFT_KEY_FILE",
              help="Use this job key (from 'mindft keygen'), shared by every node. Default: a new one.")
@click.option("--insecure", is_flag=True, help="Run the control channel without CurveZMQ (debugging only).")
@click.option("--grace-period", type=click.FloatRange(0), default=DEFAULT_GRACE_PERIOD, show_default=True,
              help="Seconds between forwarding SIGINT/SIGTERM and SIGKILL.")
@click.option("--progress-interval", type=click.FloatRange(0.1), default=DEFAULT_PROGRESS_INTERVAL,
              show_default=True, help="Seconds between progress lines while a recovery waits.")
@click.option("--no-prefix", is_flag=True, help="Do not prefix rank output with [rank N].")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging of mindft itself.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def main(**params: Any) -> None:
    """Run SCRIPT [ARGS] as NPROC ranks with mindft fault tolerance.

    Runs MindSpore's cluster as msrun does: on node 0 the scheduler
    (MS_ROLE=MS_SCHED), then the workers with the environment msrun sets
    (MS_ROLE=MS_WORKER, MS_SCHED_HOST/PORT, MS_WORKER_NUM, MS_NODE_ID, RANK_ID,
    RANK_SIZE, DEVICE_ID; MS_ENABLE_RECOVERY=1 with fault tolerance on, so a
    restarted worker rejoins) plus MS_TFT_IP/MS_TFT_PORT and MINDFT_KEY_FILE.
    msrun's option names are accepted too: change the command name and keep
    the rest. Node 0 also runs mindft's controller and its watcher of the
    device plugin's reset file. Each rank's output is printed prefixed with
    [rank N]; a crashed rank is restarted up to --max-restarts times; the
    launcher exits with the job's result.

    \b
    Exit codes: 0  every rank finished
                1  the job failed (or a rank's own crash code)
                2  bad usage or configuration; nothing was started
                3  every rank wrote its dying-gasp checkpoint
                4  a rank had to stop but could not write its checkpoint
                130/143  interrupted by SIGINT/SIGTERM
    """
    _setup_logging(params["verbose"])
    try:
        spec = plan_launch(params, os.environ)
    except UsageError as error:
        _fail(str(error))
    except ConfigError as error:
        _fail(f"configuration error: {error}")
    if params["join"] is False:
        log.warning("--join False: mindft-launch stays with the job anyway (it restarts ranks and "
                    "decides the exit code)")
    # Created only once everything is validated, so a refused launch leaves nothing behind.
    run_dir = params["run_dir"]
    made_run_dir = run_dir is None
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix="mindft-run-"))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, 0o700)
    generated_key = spec.protected and not spec.insecure and spec.key_file is None
    key_file = spec.key_file
    if generated_key:
        key_file = run_dir / "keys.json"
        generate_keys(key_file)
    spec = dataclasses.replace(spec, run_dir=run_dir, log_dir=params["log_dir"] or run_dir / "logs",
                               key_file=key_file)
    try:
        code = Launcher(spec).run()
    except ConfigError as error:
        clean_run_dir(spec, made_run_dir, generated_key)
        _fail(f"configuration error: {error}")
    clean_run_dir(spec, made_run_dir, generated_key)
    print(f"[mindft-launch] {job_verdict(code)}", flush=True)
    sys.exit(code)


def clean_run_dir(spec: LaunchSpec, made_run_dir: bool, generated_key: bool) -> None:
    """After the job: keep the logs, drop what only a running job needs.

    The generated key (a secret) and job.json (it names a controller that is gone) are
    removed; a run directory this launcher created is removed whole when it holds no log.
    """
    removable = [spec.run_dir / JOB_FILE] + ([spec.run_dir / "keys.json"] if generated_key else [])
    for path in removable:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as error:
            log.warning("could not remove %s: %s", path, error)
    logs = [p for p in spec.log_dir.glob("*") if p.is_file()] if spec.log_dir.is_dir() else []
    if logs:
        print(f"[mindft-launch] logs kept in {spec.log_dir}", flush=True)
    elif made_run_dir:
        shutil.rmtree(spec.run_dir, ignore_errors=True)


if __name__ == "__main__":
    # Run the copy in sys.modules so loggers and classes are mindft.launch's, not __main__'s.
    from mindft.launch import main as _main
    _main()
