"""The one harness of the tests that start real processes.

Free ports; the environment a job's processes get; commands whose whole process tree dies at
the end (:class:`Processes`); a controller on a thread of the test process with rank
subprocesses (:class:`ControllerJob`, and :func:`job_fixture` that kills what a test's jobs
left); the fault-free reference runs of the examples and the bit-for-bit comparison of weights.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import numpy as np
import psutil
import pytest

from mindft.net import channel

from mindft.agent import plan as launch_plan
from mindft.agent.relay import RelayShell
from mindft.config import MindftConfig, Timeouts
from mindft.controller import Controller
from mindft.net.keys import generate_keys, load_keys
from mindft.protocol import Message, StatusReply, StatusRequest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FAKE_RANK = TESTS / "fake_rank.py"  # a scriptable rank: the rank engine and a fake training loop
MINDIO_RANK = TESTS / "mindio_rank.py"  # a numpy job on MindIO's own rank API
EXAMPLES = ROOT / "examples"
RUN_TIMEOUT = 300.0  # one 2-rank MindSpore job; ~15-25 s on 2 busy cores
LAUNCH_VARIABLES = ("MINDFT_NPROC", "MINDFT_NNODES", "MINDFT_NODE_RANK", "VC_TASK_INDEX", "MINDFT_MASTER_ADDR",
                    "MINDFT_MASTER_PORT", "MINDFT_SCHEDULER", "MINDFT_KEY_FILE", "MINDFT_INSECURE", "MS_TFT_PORT")
# What configures mindft, MindSpore's cluster or MindX: a child gets only what its test gives it.
_FOREIGN = ("MS_", "MINDFT_", "MINDIO_", "MINDX_", "RANK_")


def require(module: str, what: str) -> None:
    """Skip the test when ``module`` cannot be imported (``what`` says what is missing and how to
    install it); fail instead when ``CI`` is set: there every test must run."""
    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what}; in CI this test must run, not skip")
    pytest.skip(what)


def free_port() -> int:
    """A port free on 127.0.0.1 right now (for a server the test starts with a port of its choosing)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the scheduler and the controller), as mindft-launch picks them."""
    return launch_plan.free_port_pair("127.0.0.1")


def environment(tmp_path: Optional[Path] = None, **changes: str) -> dict[str, str]:
    """This process's environment without mindft's, MindSpore's and MindX's variables, mindft
    importable, the reset file under ``tmp_path`` (when given), then ``changes``."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(_FOREIGN) or name == "MINDFT_PRELOAD"}  # conftest's, per test tier
    for name in (*LAUNCH_VARIABLES, "DEVICE_ID"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if tmp_path is not None:
        env["MINDFT_RESET_FILE"] = str(tmp_path / "reset.json")
    env.update(changes)
    return env


class Processes:
    """Every command a test starts; the whole process tree of each is killed at the end."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.seen: dict[int, psutil.Process] = {}

    def start(self, argv: list[str], env: dict[str, str], output: Path) -> subprocess.Popen:
        """``argv`` in a session of its own (its tree can be killed at once), output into ``output``."""
        with open(output, "wb") as out:
            process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                       start_new_session=True)
        self.started.append(process)
        return process

    def run(self, argv: list[str], env: dict[str, str], output: Path,
            timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
        """:meth:`start`, then wait for it: (exit code, output); the test fails when it runs over ``timeout``."""
        process = self.start(argv, env, output)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            self.remember(process.pid)
            time.sleep(0.2)
        if process.poll() is None:
            self.kill_all()
            pytest.fail(f"{argv[2]} did not finish in {timeout}s:\n{output.read_text(errors='replace')[-4000:]}")
        return process.returncode, output.read_text(errors="replace")

    def remember(self, pid: int) -> None:
        """Note every descendant of ``pid`` now, so :meth:`kill_all` finds it after its parent died."""
        # Ranks and schedulers start sessions of their own: only the tree finds them all.
        try:
            for child in psutil.Process(pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def remember_all(self) -> None:
        for process in self.started:
            self.remember(process.pid)

    def leftovers(self) -> list[str]:
        """The command lines of processes seen during the run that are still alive."""
        alive = []
        for process in self.seen.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(process.cmdline()[:3]))
            except psutil.NoSuchProcess:
                pass
        return alive

    def kill_all(self) -> None:
        self.remember_all()
        for process in [*self.seen.values(), *(psutil.Process(p.pid) for p in self.started if p.poll() is None)]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        for process in self.started:
            if process.poll() is None:
                process.wait(10)


def end_job(procs: Iterable[subprocess.Popen], controller: Optional[Controller]) -> None:
    """Kill a hand-made job's processes that still run and stop its controller."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot die otherwise
            except ProcessLookupError:
                pass
            proc.kill()
        proc.wait(10)
    if controller is not None:
        controller.stop()


def start_controller(config: MindftConfig, agent: Optional[Callable[[Message], None]] = None
                     ) -> tuple[Controller, MindftConfig]:
    """A controller on a thread of this process (``config.controller_port`` 0: a free port), and
    the config its clients use (the port it bound). ``agent``: the node agent of every rank in
    this process, given the job's orders and view (as :meth:`Controller.attach_agent`). The
    caller stops it."""
    controller = Controller(config)
    if agent is not None:
        controller.attach_agent(0, tuple(range(config.world_size)), agent)
    controller.start()
    port = int(controller.endpoint.rsplit(":", 1)[1])
    return controller, dataclasses.replace(config, controller_port=port)


class ControllerJob:
    """A controller on a thread of the test process and rank subprocesses on 127.0.0.1.

    A test module subclasses it with the command its ranks run; ``agent`` plays the node agent of
    every rank (it is given the job's orders), ``config`` more MindftConfig fields. The ranks talk to
    the controller through a relay in this process, as a node agent's (``relay=False``: directly).
    :meth:`cleanup` kills whatever is left (:func:`job_fixture` calls it)."""

    def __init__(self, tmp: Path, world_size: int, timeouts: Timeouts, secure: bool = False,
                 agent: Optional[Callable[[Message], None]] = None, relay: bool = True, **config: Any) -> None:
        self.tmp, self.world_size, self.timeouts = tmp, world_size, timeouts
        tmp.mkdir(parents=True, exist_ok=True)
        self.key_file: Optional[Path] = None
        if secure:
            self.key_file = tmp / "job.key"
            generate_keys(self.key_file)
        self.started: list[subprocess.Popen] = []
        self.logs: list[Path] = []  # every rank's, in the order they were started
        server = MindftConfig(world_size=world_size, controller_port=0, insecure=not secure,
                              key_file=self.key_file, timeouts=timeouts, **config)
        self.controller, self.config = start_controller(server, agent)
        self.port = self.config.controller_port
        self.relay: Optional[RelayShell] = None
        if relay:
            keys = load_keys(self.key_file) if self.key_file else None
            self.relay = RelayShell(0, self.config.controller_address, keys, timeouts, tmp)

    def rank_environment(self, rank: int, restart_count: int = 0, **extra: str) -> dict[str, str]:
        """What a rank needs to find this job's controller, with its heartbeat timeouts, then ``extra``."""
        env = environment(MS_WORKER_NUM=str(self.world_size), MS_NODE_ID=str(rank), MS_TFT_IP="127.0.0.1",
                          MS_TFT_PORT=str(self.port), MINDFT_RESTART_COUNT=str(restart_count),
                          MINDFT_HEARTBEAT_INTERVAL=str(self.timeouts.heartbeat_interval),
                          MINDFT_HEARTBEAT_MISSES=str(self.timeouts.heartbeat_misses),
                          PYTHONFAULTHANDLER="1")  # hung(): SIGABRT prints every thread's stack
        env.update({"MINDFT_KEY_FILE": str(self.key_file)} if self.key_file else {"MINDFT_INSECURE": "1"})
        if self.relay is not None:
            env["MINDFT_RELAY"] = self.relay.endpoint
        env.update(extra)
        return env

    def start(self, argv: Sequence[str], env: dict[str, str], log: Path, stdout: bool = False) -> subprocess.Popen:
        """A rank process, its stderr (and its stdout when ``stdout``, else nothing) appended to ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, *argv], env=env, cwd=self.tmp,
                                    stdout=out if stdout else subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT if stdout else out)
        self.started.append(proc)
        if log not in self.logs:
            self.logs.append(log)
        return proc

    def status(self) -> StatusReply:
        keys = load_keys(self.key_file) if self.key_file else None
        reply = channel.request(self.config.controller_address, keys, StatusRequest(), 5.0)
        assert isinstance(reply, StatusReply)
        return reply

    def wait_for(self, predicate: Callable[[], object], what: str, timeout: float = 30.0,
                 every: float = 0.02) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; {self.hung()}")
            time.sleep(every)

    def hung(self) -> str:
        """Why a rank still runs, for a failure message: the controller's state, then every rank's
        log with the Python stack of each thread of a rank still running (aborted to print it)."""
        running = [proc for proc in self.started if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGABRT)
        for proc in running:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        return f"controller {self.controller.state}; logs:\n{self.tail(8000)}"

    def tail(self, characters: int = 3000) -> str:
        """The end of every rank's log, for a failure message."""
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-characters:]}"
                         for log in self.logs if log.exists())

    def result(self, timeout: float = 60.0):
        """The controller's result once it ended; the test fails if it still runs after ``timeout``."""
        result = self.controller.join(timeout)
        assert result is not None, f"controller still running in {self.controller.state}; {self.tail()}"
        return result

    def cleanup(self) -> None:
        end_job(self.started, self.controller)
        if self.relay is not None:
            self.relay.close()


J = TypeVar("J")
T = TypeVar("T")


def job_fixture(make: Callable[..., J]):
    """A ``make_job`` fixture for a test module: ``make_job(*args)`` is ``make(directory, *args)``
    with a directory of its own under the test's tmp_path; every job made has its ``cleanup()``
    called at the end of the test."""

    @pytest.fixture
    def make_job(tmp_path: Path) -> Iterator[Callable[..., J]]:
        jobs: list = []

        def made(*args: Any, **kwargs: Any) -> J:
            directory = tmp_path / f"job{len(jobs)}"
            directory.mkdir()
            jobs.append(make(directory, *args, **kwargs))
            return jobs[-1]

        try:
            yield made
        finally:
            for job in reversed(jobs):
                job.cleanup()
    return make_job


def fault_free_weights(out: Path, runs: Iterable[tuple[str, int, Sequence[str]]], timeout: float = 240.0) -> Path:
    """Run examples/<example>.py with mindft off for each (example, world size, arguments), every
    rank in turn in one process (one MindSpore import); rank r's final weights and optimizer
    state land in ``out/<example>/<world size>/rank<r>.npz``. Returns ``out``."""
    runs = [(example, world, list(args)) for example, world, args in runs]
    code = f"""
import importlib, os, sys
sys.path.insert(0, {str(EXAMPLES)!r})
for example, world, args in {runs!r}:
    for rank in range(world):
        os.environ.update(MS_WORKER_NUM=str(world), MS_NODE_ID=str(rank))
        importlib.import_module(example).main(args + ["--out", os.path.join({str(out)!r}, example, str(world))])
"""
    subprocess.run([sys.executable, "-c", code], env=environment(GLOG_v="3", PYTHONUNBUFFERED="1"), check=True,
                   timeout=timeout, stdout=subprocess.DEVNULL)
    return out


# What the examples train in the tests that compare with a fault-free run (train_mlp.py: 8
# batches per epoch, so 14 steps cross an epoch; train_model.py: 2 epochs of 8 batches).
EXAMPLE_ARGS: dict[str, tuple[str, ...]] = {"train_mlp": ("--steps", "14"), "train_model": ("--epochs", "2")}


class ExampleReferences:
    """The examples' fault-free weights (:func:`fault_free_weights` of :data:`EXAMPLE_ARGS`), each
    (example, world size) computed once per test process and shared by every module that asks
    (the ``example_references`` fixture: with ``--dist loadfile``, once per worker)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.computed: set[tuple[str, int]] = set()

    def need(self, *runs: tuple[str, int]) -> Path:
        """Compute the (example, world size) runs not computed yet, in one process; returns the
        directory that holds ``<example>/<world size>/rank<r>.npz`` for every run asked."""
        missing = [run for run in dict.fromkeys(runs) if run not in self.computed]
        if missing:
            fault_free_weights(self.out, [(example, world, EXAMPLE_ARGS[example]) for example, world in missing])
            self.computed.update(missing)
        return self.out


def weights(directory: Path, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s final weights as an example wrote them (``directory/rank<rank>.npz``)."""
    with np.load(directory / f"rank{rank}.npz") as data:
        return {name: data[name] for name in data.files}


def assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str = "weights") -> None:
    """The same arrays under the same names, bit for bit (dtype included)."""
    assert sorted(got) == sorted(want), f"{what}: {sorted(got)} != {sorted(want)}"
    different = [name for name in want
                 if got[name].dtype != want[name].dtype or got[name].tobytes() != want[name].tobytes()]
    assert not different, f"{what}: {different} differ"


def assert_ranks_identical(out: Path, reference: Path, world_size: int, moments: str = "moment1.") -> None:
    """Every rank's final weights in ``out`` equal the fault-free ones in ``reference``, optimizer
    state included (its parameters' names start with ``moments``: Adam's, or ``adam_m.`` AdamW's)."""
    for rank in range(world_size):
        want = weights(reference, rank)
        assert any(name.startswith(moments) for name in want)  # optimizer state is compared too
        assert_identical(weights(out, rank), want, f"rank {rank} vs the fault-free run")


class Hosts:
    """Network namespaces as hosts on one link: host ``i`` at ``10.77.0.(i+1)`` (each with its own
    loopback), two joined by a veth pair, more by a bridge in a namespace of its own (the switch).
    Names are unique to this object; :meth:`close` kills every process left in them and removes
    them (the links go with them). Needs root and iproute2's ``ip``: :func:`hosts_or_skip` says so
    in one line."""

    ADDRESSES = tuple(f"10.77.0.{i + 1}" for i in range(8))

    def __init__(self, count: int = 2) -> None:
        tag = f"mft{os.getpid() % 100000}{os.urandom(2).hex()}"  # a veth name holds at most 15 characters
        self.names = tuple(f"{tag}n{i}" for i in range(count))
        self.links = tuple(f"{tag}v{i}" for i in range(count))
        self.switch = f"{tag}sw" if count > 2 else ""
        self.created: list[str] = []
        try:
            for name in (*self.names, *([self.switch] if self.switch else [])):
                _ip("netns", "add", name)
                self.created.append(name)
            if not self.switch:
                _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            else:
                _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
                _ip("-n", self.switch, "link", "set", "br0", "up")
                for i, link in enumerate(self.links):
                    port = f"{tag}p{i}"
                    _ip("link", "add", link, "type", "veth", "peer", "name", port)
                    _ip("link", "set", port, "netns", self.switch)
                    _ip("-n", self.switch, "link", "set", port, "master", "br0")
                    _ip("-n", self.switch, "link", "set", port, "up")
            for name, link, address in zip(self.names, self.links, self.ADDRESSES):
                _ip("link", "set", link, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                _ip("-n", name, "link", "set", link, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``node`` (``ip netns exec`` execs it: the process is ``argv``'s own)."""
        return ["ip", "netns", "exec", self.names[node], *argv]

    def pids(self, node: int) -> list[int]:
        """Every process in host ``node``'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.names[node]], capture_output=True, text=True, timeout=10)
        return [int(pid) for pid in out.stdout.split()]

    def kill(self, node: int) -> list[int]:
        """SIGKILL every process on host ``node`` at once, as a pod dies; returns their pids once all are gone."""
        victims: list[int] = []
        deadline = time.monotonic() + 10
        while (pids := self.pids(node)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            victims.extend(p for p in pids if p not in victims)
            time.sleep(0.05)
        return victims

    def call(self, node: int, function: Callable[[], T]) -> T:
        """``function()`` on a thread of this process that joined host ``node``'s network (setns
        is per thread: the sockets it opens, ZeroMQ's I/O thread included, live there)."""
        import ctypes
        import threading

        result: list = []

        def run() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            descriptor = os.open(f"/var/run/netns/{self.names[node]}", os.O_RDONLY)
            try:
                if libc.setns(descriptor, 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), f"setns into {self.names[node]}")
            finally:
                os.close(descriptor)
            try:
                result.append((True, function()))
            except BaseException as error:  # re-raised on the caller's thread
                result.append((False, error))

        thread = threading.Thread(target=run, name=f"netns-{node}")
        thread.start()
        thread.join()
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def name(self, node: int, name: str, address: str) -> None:
        """Host ``node`` resolves ``name`` to ``address`` from now on (``ip netns exec`` binds
        /etc/netns/NAMESPACE/hosts over /etc/hosts: the file is rewritten in place, so processes
        already started read the new address too), as a cluster's DNS after a pod moved."""
        hosts = Path("/etc/netns") / self.names[node] / "hosts"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        with open(hosts, "w") as handle:  # the same file: a bind mount follows its inode
            handle.write(f"127.0.0.1 localhost\n{address} {name}\n")

    def link(self, node: int, up: bool) -> None:
        """Bring host ``node``'s end of the link up or down (down: a partition; nothing crosses)."""
        _ip("-n", self.names[node], "link", "set", self.links[node], "up" if up else "down")

    def close(self) -> None:
        import shutil

        for node, name in enumerate(self.created):
            if node < len(self.names):
                self.kill(node)
            _ip("netns", "delete", name)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        self.created = []


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def hosts_or_skip() -> None:
    """Skip, in one line, where network namespaces cannot be made (not root, no ``ip``); in CI
    (the CI variable set) fail instead: there the tests of several hosts must run."""
    import shutil

    missing = ("not root" if os.geteuid() != 0 else "") or ("" if shutil.which("ip") else "no `ip` (iproute2)")
    if not missing:
        return
    message = f"several hosts need network namespaces: {missing}"
    if os.environ.get("CI"):
        pytest.fail(f"{message}; in CI the tests of several hosts must run, not skip")
    pytest.skip(message)


def snapshot_state(value: float, size: int = 1000) -> dict:
    """A small training state whose every element encodes ``value``."""
    return {
        "w": np.full((size // 10, 10), value, np.float32),
        "adam.m": np.full(size, value, np.float64),
        "step": np.array(int(value), np.int64),
    }


class Throttle:
    """Process ``pid`` gets ``share`` of the wall time: stopped, then let run, every 60 ms."""

    def __init__(self, pid: int, share: float) -> None:
        self.pid, self.share = pid, share
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = 0.06
        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(period * (1 - self.share))
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(period * self.share)
        except ProcessLookupError:
            pass  # it ended (killed, or its node given away)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
