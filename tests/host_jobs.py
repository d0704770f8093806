"""A data-parallel job over hosts made of network namespaces (:class:`harness.Hosts`): each node's
mindft-launch, and each warm spare's, in a namespace of its own; examples/train_dp.py with MCCL
all-reducing across the link; the job's key made by ``mindft keygen`` and shared by every node.
Used by tests/integration/agent/test_two_hosts.py and test_three_hosts.py."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

from harness import ROOT, Hosts, Processes, environment, free_port_pair, hosts_or_skip
from mindft.net.channel import Client, ControllerUnreachable
from mindft.net.keys import load_keys
from mindft.protocol import StatusReply

DP_SCRIPT = ROOT / "examples" / "train_dp.py"
PORT = 29600  # each namespace has ports of its own: nothing else listens there
WAIT = 240.0  # for a job's phase on 2 busy cores
# 64 steps of 0.15 s leave time to act mid-training (and a fault at step 55); faults are found
# within 2 s (dead_after), a rank gives up on a silent controller after 10 s, a lost rank may take
# 60 s to come back (the restarted node imports MindSpore and joins a new cluster).
EPOCHS = ("--epochs", "4")
JOB_ARGS = (*EPOCHS, "--step-seconds", "0.15")
STEPS = 64  # 4 epochs of 256 samples, batches of 8 per rank on 2 ranks
TIMEOUTS = {"MINDFT_HEARTBEAT_INTERVAL": "0.2", "MINDFT_HEARTBEAT_MISSES": "10", "MINDFT_CONNECT_RETRIES": "5",
            "MINDFT_STALL_TIMEOUT": "2", "MINDFT_PAUSE_TIMEOUT": "20", "MINDFT_RESUME_TIMEOUT": "20",
            "MINDFT_REPAIR_TIMEOUT": "60", "MINDFT_SNAPSHOT_EVERY": "1"}
PARTITION_REPAIR_TIMEOUT = "30"  # s, for the partition: timeouts.repair of 60 s would only make it longer
PARTITION = 45.0  # s: longer than every timeout (that repair timeout included) and MCCL's own (~30 s)


def launch_one_host(processes: Processes, tmp: Path, name: str, *script_args: str) -> Path:
    """The same job, both ranks on one host, nothing acting mid-training, so its steps need no
    sleep (a sleep changes no weight); returns its weights' directory."""
    run_dir = tmp / name
    argv = [sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--master_port", str(free_port_pair()),
            "--run-dir", str(run_dir), "--cluster_time_out", "120", str(DP_SCRIPT), *EPOCHS,
            *script_args, "--out", str(run_dir / "out")]
    env = environment(tmp, MS_ENABLE_TFT="{RSC:1}", MINDFT_DUMP_DIR=str(run_dir / "dump"), **TIMEOUTS)
    code, output = processes.run(argv, env, tmp / f"{name}.out")
    assert code == 0, output[-4000:]
    return run_dir / "out"


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Fault-free final weights per API (``model``, ``loop``), computed once."""
    cache: dict[str, Path] = {}
    tmp = tmp_path_factory.mktemp("hosts-reference")

    def reference(api: str) -> Path:
        if api not in cache:
            tracker = Processes()
            try:
                cache[api] = launch_one_host(tracker, tmp, api, *(["--loop"] if api == "loop" else []))
            finally:
                tracker.kill_all()
        return cache[api]
    return reference


class HostsJob:
    """The job's launchers, one per host (node ``i`` on host ``i`` at first; spares on the hosts
    after them), each on an output file of its own. ``nodes``: the job's nodes (``--nnodes``)."""

    def __init__(self, hosts: Hosts, processes: Processes, tmp: Path, *script_args: str, nodes: int = 2,
                 launch_args: tuple[str, ...] = (), master_addr: str = Hosts.ADDRESSES[0],
                 script: Path = DP_SCRIPT, job_args: tuple[str, ...] = JOB_ARGS, node_range: str = "",
                 **changes: Optional[str]) -> None:
        self.hosts, self.processes, self.tmp, self.nodes = hosts, processes, tmp, nodes
        self.script, self.node_range = script, node_range or str(nodes)  # --nnodes: N, or MIN:MAX
        self.master_addr = master_addr  # node 0's --master-addr: its address, or a name (Hosts.name)
        self.launch_args = launch_args  # every launcher's, e.g. ("--standbys", "1")
        self.controller_host = 0  # where the status is asked (a standby's host once it took over)
        self.key_file = tmp / "keys.json"
        subprocess.run([sys.executable, "-m", "mindft.cli.main", "keygen", str(self.key_file)], check=True,
                       env=environment(), capture_output=True, timeout=60)
        self.keys = load_keys(self.key_file)
        self.script_args = (*job_args, *script_args, "--out", str(tmp / "out"))
        # TIMEOUTS with ``changes`` (None: unset).
        self.timeouts = {k: v for k, v in {**TIMEOUTS, **changes}.items() if v is not None}
        self.launchers: dict[str, subprocess.Popen] = {}
        self.started_at: dict[str, float] = {}

    def start(self, name: str, node: Optional[int], host: Optional[int] = None) -> None:
        """Launcher ``name`` for node ``node`` (None: a warm spare) on host ``host`` (default: ``node``'s)."""
        role = ["--spare"] if node is None else ["--node-rank", str(node)]
        argv = [sys.executable, "-m", "mindft.cli.launch", "--nproc", "1", "--nnodes", self.node_range, *role,
                "--master-addr", self.master_addr, "--master-port", str(PORT), "--key-file", str(self.key_file),
                "--run-dir", str(self.tmp / f"run-{name}"), "--cluster_time_out", "120", *self.launch_args,
                str(self.script), *self.script_args]
        dump = self.dump_dir(node) if node is not None else self.tmp / f"dump-{name}"
        env = environment(self.tmp, MS_ENABLE_TFT="{RSC:1}", MINDFT_DUMP_DIR=str(dump),
                          MINDFT_RESET_FILE=str(self.tmp / f"reset-{name}.json"), **self.timeouts)
        on = host if host is not None else node
        assert on is not None, "a spare needs a host"
        self.launchers[name] = self.processes.start(self.hosts.command(on, argv), env, self.tmp / f"{name}.out")
        self.started_at[name] = time.monotonic()

    def start_training(self) -> StatusReply:
        """Every node's launcher, until the job trains; the job's status then."""
        for node in range(self.nodes):
            self.start(f"node{node}", node)
        return self.until("training on every host", training)

    def dump_dir(self, node: int) -> Path:
        return self.tmp / f"dump-node{node}"

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- {name}\n{self.output(name)[-4000:]}" for name in self.launchers)

    def status(self) -> Optional[StatusReply]:
        """The controller's status, asked from its host (None: no answer)."""
        host = self.controller_host
        client = Client(f"{Hosts.ADDRESSES[host]}:{PORT + 1}", self.keys, timeout=2.0)
        try:
            return self.hosts.call(host, client.status)
        except ControllerUnreachable:
            return None

    def until(self, what: str, ready: Callable[[StatusReply], bool]) -> StatusReply:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            for name, launcher in self.launchers.items():
                assert launcher.poll() is None, f"{name} ended before {what}:\n{self.outputs()}"
            status = self.status()
            if status is not None and ready(status):
                return status
            time.sleep(0.2)
        pytest.fail(f"no {what} within {WAIT:g} s:\n{self.outputs()}")

    def lose(self, name: str, host: int) -> float:
        """Host ``host`` (launcher ``name``'s) dies: every process in it at once, and its agent's shared
        memory (a pod's /dev/shm goes with it). Returns when it happened."""
        victims = self.hosts.kill(host)
        assert victims, f"nothing ran on host {host}"
        lost_at = time.monotonic()
        self.launchers[name].wait(10)
        memory = re.search(r"the ranks' snapshots live in (\S+) \(shared memory", self.output(name))
        assert memory, self.output(name)[-3000:]
        shutil.rmtree(memory[1], ignore_errors=True)
        return lost_at

    def wait(self, name: str) -> int:
        try:
            return self.launchers[name].wait(WAIT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still runs after {WAIT:g} s:\n{self.outputs()}")


def made_hosts(count: int) -> Iterator[Hosts]:
    """``count`` hosts for one test (the body of a test module's ``hosts`` fixture)."""
    hosts_or_skip()
    made = Hosts(count)
    try:
        yield made
    finally:
        made.close()


def assert_nothing_left(hosts: Hosts) -> None:
    for host in range(len(hosts.names)):
        assert hosts.pids(host) == [], f"processes left on host {host}: {hosts.pids(host)}"


def training(status: StatusReply) -> bool:
    return status.state == "NORMAL" and status.step >= 8
