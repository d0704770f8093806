"""What ``mindft-launch`` is asked to run, validated: the :class:`LaunchSpec` from the command
line and the environment (msrun's option names as synonyms), and the environment of each
process it starts (MindSpore's scheduler and workers as msrun sets it, plus mindft's variables).

No side effects: nothing here starts, binds (beyond probing free ports) or writes anything.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import random
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from mindft.config import MINDX_TASK_VARIABLE, STEP_GATE_VARIABLE, ConfigError, load_config, parse_node_range
from mindft.flow.spares import silent_after
from mindft.flow.topology import Topology
from mindft.net.keys import load_keys
from mindft.net.address import host_address, node_ip, port_in_use
from mindft.preflight import check_launchable, choose_backend

log = logging.getLogger(__name__)

JOB_FILE = "job.json"  # in the run directory: what `mindft status --job` and the demo need to find the job
DEFAULT_GRACE_PERIOD = 10.0     # after forwarding SIGINT/SIGTERM, before SIGKILL
DEFAULT_PROGRESS_INTERVAL = 5.0  # between progress lines while a recovery waits
DEFAULT_CLUSTER_TIME_OUT = 600  # msrun's --cluster_time_out: MS_TOPO_TIMEOUT, for the cluster to form
MULTI_NODE_MASTER_PORT = 29600  # --master-port of a job on several nodes when none is given
# MindSpore's cluster heartbeat: a worker learns that the cluster formed only from its next
# heartbeat's reply, and sleeps a random whole number of seconds in MS_RETRY_INTERVAL_LOWER..
# MS_RETRY_INTERVAL_UPPER (default 3..5) between heartbeats; 1..1 bounds that wait by 1 s. 0 would
# make the heartbeat a busy loop against the scheduler for the whole job. MindSpore counts more
# than 256 workers as a large cluster, where the interval paces the scheduler's load: its defaults
# stay there.
HEARTBEAT_INTERVAL = ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER")
SHORT_HEARTBEAT_SECONDS = 1
SHORT_HEARTBEAT_MAX_WORKERS = 256


def resolve_ip(address: str, option: str = "--master-addr") -> str:
    """The IP address of ``address`` (a host name such as a Volcano pod name, or an IP), given as ``option``."""
    ip = host_address(address)
    if ip is None:
        raise ConfigError(f"{option}: cannot resolve {address!r}") from None
    return ip


@dataclass(frozen=True)
class LaunchSpec:
    """Everything the launcher was asked to do, validated."""

    command: tuple[str, ...]
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_ip: str = "127.0.0.1"
    controller_port: int = 29600
    # MindSpore's scheduler (MS_SCHED_PORT) on node 0; None: the ranks get no MS_ROLE/MS_SCHED_*
    # and no scheduler runs (a script that never calls mindspore.communication.init()).
    scheduler_port: Optional[int] = None
    cluster_time_out: int = DEFAULT_CLUSTER_TIME_OUT
    max_restarts: int = 3
    run_dir: Path = Path(".")
    log_dir: Path = Path(".")
    key_file: Optional[Path] = None
    insecure: bool = False
    grace_period: float = DEFAULT_GRACE_PERIOD
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL
    env: Mapping[str, str] = field(default_factory=dict)
    prefix_output: bool = True
    # MindSpore's own INFO/WARNING log lines on the console too (default: only in each rank's log file).
    console_mindspore_logs: bool = False
    # False when MS_ENABLE_TFT asks for no fault tolerance: the ranks run as under msrun,
    # with no controller, no keys and no restarts.
    protected: bool = True
    # The node agent's shared memory: each rank's snapshots live in state_dir/rank<R> and
    # outlive the rank's process; removed when the launcher ends.
    state_dir: Optional[Path] = None
    # True when MindIO TFT coordinates the job (MINDFT_BACKEND): node 0 runs MindIO's controller
    # and the step gate instead of mindft's controller, and a lost rank is not restarted.
    mindio: bool = False
    # This node agent's replica keeper (mindft.replica) when the agents replicate (several
    # nodes, MINDFT_AGENT_REPLICATION=1): the ranks announce it and push nothing themselves.
    replica_endpoint: Optional[str] = None
    # The node agent's relay (mindft.agent.relay): its ranks talk to the controller through it.
    relay_endpoint: str = ""
    # Where the node serves its Prometheus metrics (--metrics-port; None: nowhere): node 0 the
    # controller's and its own, the other nodes their own.
    metrics_port: Optional[int] = None
    metrics_ip: str = "127.0.0.1"
    # --master-addr as given: a host name is resolved again when the controller falls silent (a pod
    # rescheduled onto another host keeps its name, not its address); "": master_ip itself.
    master_addr: str = ""
    # A warm spare (--spare): no ranks and node_rank -1 until the controller gives it a lost node.
    spare: bool = False
    # Nodes 1..standbys stand by for the controller (--standbys, mindft.flow.standby).
    standbys: int = 0
    # The node whose host runs the controller and MindSpore's scheduler: 0, or the standby that took
    # over (-1: another node's, which this agent followed; master_ip is that host).
    controller_node: int = 0

    @property
    def world_size(self) -> int:
        """Ranks in the job, over every node."""
        return self.nproc * self.nnodes

    @property
    def topology(self) -> Topology:
        """How the job's ranks are laid out over its nodes, and who keeps whose replica."""
        return Topology(self.nproc, self.nnodes)

    @property
    def local_ranks(self) -> range:
        """Global ranks started on this node (none on a spare)."""
        return range(0) if self.spare else self.topology.ranks_of(self.node_rank)

    @property
    def controller_address(self) -> str:
        """Where the controller listens."""
        host = f"[{self.master_ip}]" if ":" in self.master_ip else self.master_ip
        return f"tcp://{host}:{self.controller_port}"

    @property
    def runs_scheduler(self) -> bool:
        """True when this node starts MindSpore's scheduler (node 0 of a job that uses it)."""
        return self.scheduler_port is not None and self.node_rank == self.controller_node


def cluster_environment(spec: LaunchSpec) -> dict[str, str]:
    """What msrun sets in every process of MindSpore's cluster (none without a scheduler), and
    the heartbeat interval that lets the cluster form without seconds of idle waiting.

    ``MS_ENABLE_RECOVERY=1`` when fault tolerance is on, as msrun sets it when an external
    agent controls the workers: without it the scheduler refuses a restarted worker
    ("Repeated registration node"). MindSpore 2.10 reads no ``MS_RECOVERY_PATH``.
    ``MS_RETRY_INTERVAL_LOWER``/``UPPER`` = 1 on clusters of up to 256 workers, unless the
    job's environment sets either of them: the user's pair is then left whole.
    """
    if spec.scheduler_port is None:
        return {}
    env = {"MS_SCHED_HOST": spec.master_ip, "MS_SCHED_PORT": str(spec.scheduler_port),
           "MS_WORKER_NUM": str(spec.world_size), "MS_TOPO_TIMEOUT": str(spec.cluster_time_out)}
    if spec.world_size <= SHORT_HEARTBEAT_MAX_WORKERS and not any(name in spec.env for name in HEARTBEAT_INTERVAL):
        env.update(dict.fromkeys(HEARTBEAT_INTERVAL, str(SHORT_HEARTBEAT_SECONDS)))
    if spec.protected:
        env["MS_ENABLE_RECOVERY"] = "1"
    return env


def scheduler_environment(spec: LaunchSpec) -> dict[str, str]:
    """The scheduler's environment: the job's, plus MS_ROLE=MS_SCHED (RANK_ID 0, as msrun)."""
    env = dict(spec.env)
    env.update(cluster_environment(spec))
    env.update({"MS_ROLE": "MS_SCHED", "RANK_ID": "0", "RANK_SIZE": str(spec.world_size),
                "PYTHONUNBUFFERED": "1"})  # as the workers': forked from the same warm process
    for worker_only in ("MS_NODE_ID", "DEVICE_ID"):
        env.pop(worker_only, None)
    return env


def rank_environment(spec: LaunchSpec, rank: int, restart_count: int) -> dict[str, str]:
    """The environment of one rank: what msrun sets, plus mindft's variables."""
    env = dict(spec.env)
    local_rank = rank - spec.node_rank * spec.nproc
    env.update({
        "MS_WORKER_NUM": str(spec.world_size), "RANK_SIZE": str(spec.world_size),
        "MS_NODE_ID": str(rank), "RANK_ID": str(rank),
        "DEVICE_ID": str(local_rank), "LOCAL_RANK": str(local_rank),
        "MINDFT_RESTART_COUNT": str(restart_count), "MINDFT_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",  # so prefixed console output is live
    })
    if spec.scheduler_port is not None:
        env.update(cluster_environment(spec))
        env["MS_ROLE"] = "MS_WORKER"
    if not spec.protected:
        # No controller runs: its address would be a placeholder (port 0 when none was chosen),
        # which the ranks' configuration rightly refuses.
        return env
    env.update({"MS_TFT_IP": spec.master_ip, "MS_TFT_PORT": str(spec.controller_port)})
    if spec.relay_endpoint:
        env["MINDFT_RELAY"] = spec.relay_endpoint
    if spec.state_dir is not None:
        env["MINDFT_STATE_DIR"] = str(spec.state_dir / f"rank{rank}")
        if spec.replica_endpoint:
            env["MINDFT_REPLICA_ENDPOINT"] = spec.replica_endpoint
            env["MINDFT_REPLICA_BUDDY"] = "-1"  # the node agents replicate, off the step
        else:
            # The agent's memory outlives the process; a replica is for the loss of the node.
            buddy = spec.topology.buddy_rank(rank)
            env.setdefault("MINDFT_REPLICA_BUDDY", str(-1 if buddy is None else buddy))
    if spec.mindio and not env.get(MINDX_TASK_VARIABLE, "").strip():
        env[STEP_GATE_VARIABLE] = mindio_gate_address(spec)
    if spec.insecure:
        env["MINDFT_INSECURE"] = "1"
        env.pop("MINDFT_KEY_FILE", None)
    else:
        env["MINDFT_KEY_FILE"] = str(spec.key_file)
        env.pop("MINDFT_INSECURE", None)
    return env


def mindio_gate_address(spec: LaunchSpec) -> str:
    """Where node 0's step gate listens: the port after MindIO's controller port, on every node alike."""
    host = f"[{spec.master_ip}]" if ":" in spec.master_ip else spec.master_ip
    return f"tcp://{host}:{spec.controller_port + 1}"


def ascend_present() -> bool:
    """True when this node has Ascend NPUs (their device files), without importing MindSpore."""
    return any(Path("/dev").glob("davinci[0-9]*"))


class UsageError(Exception):
    """The command line asks for a launch that cannot work; nothing was started (exit 2)."""


MSRUN_OPTIONS = ("--worker_num", "--local_worker_num", "--master_addr", "--master_port", "--node_rank",
                 "--log_dir", "--join", "--cluster_time_out")


def _training_command(script: str, script_args: Sequence[str]) -> tuple[str, ...]:
    """The rank command line; a script that is not there is a usage error before anything starts."""
    if script.startswith("-"):
        raise UsageError(f"unknown option {script!r}; of msrun's options mindft-launch accepts "
                         f"{', '.join(MSRUN_OPTIONS)} (see --help)")
    if script.endswith(".py"):
        if not Path(script).is_file():
            raise UsageError(f"training script {script!r} does not exist (looked in {os.getcwd()})")
        return (sys.executable, script, *script_args)
    if shutil.which(script) is None:
        raise UsageError(f"training command {script!r} is not an executable file or on PATH")
    return (script, *script_args)


def resolve_world(nproc: Optional[int], nnodes: Optional[int], worker_num: Optional[int]) -> tuple[int, int]:
    """(ranks per node, nodes) from mindft's --nproc/--nnodes and msrun's --worker_num (every rank).

    msrun's ``--local_worker_num`` is ``--nproc``; ``--worker_num`` must be a whole number of
    nodes' worth of ranks (every node runs the same number, as mindft numbers ranks node by node).
    """
    if worker_num is None:
        return nproc or 1, nnodes or 1
    if nproc is None:
        nproc, remainder = divmod(worker_num, nnodes or 1)
        if remainder or not nproc:
            raise UsageError(f"--worker_num {worker_num} cannot be split evenly over --nnodes {nnodes}; "
                             f"give --local_worker_num (ranks on each node)")
        return nproc, nnodes or 1
    nodes, remainder = divmod(worker_num, nproc)
    if remainder or not nodes:
        raise UsageError(f"--worker_num {worker_num} is not a multiple of --local_worker_num/--nproc {nproc}: "
                         f"every node runs the same number of ranks")
    if nnodes is not None and nnodes != nodes:
        raise UsageError(f"--worker_num {worker_num} with --local_worker_num/--nproc {nproc} makes {nodes} "
                         f"node(s), but --nnodes is {nnodes}")
    return nproc, nodes


def free_port_pair(ip: str) -> int:
    """A port p with p and p + 1 free on ``ip`` right now, for servers that cannot bind port 0
    themselves (MindSpore's scheduler and mindft's controller; MindIO's controller and step gate).

    Drawn at random below the kernel's ephemeral range: a port from that range can be taken by
    any outgoing connection between this probe and the server's bind, and on a busy machine
    the range itself runs out."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for port in random.sample(range(20000, max(20100, ephemeral_low - 2)), 200):
        try:
            with socket.socket(family) as first, socket.socket(family) as second:
                first.bind((ip, port))
                second.bind((ip, port + 1))
            return port
        except OSError:
            continue
    raise ConfigError(f"found no two adjacent free ports on {ip} in 20000..{ephemeral_low - 1}; pass --master-port")


def resolve_ports(master_port: Optional[int], nnodes: int, master_ip: str, scheduler: bool,
                  tft_port: Optional[int]) -> tuple[Optional[int], int]:
    """(scheduler port or None, controller port; 0 = the controller binds a free one).

    ``--master-port`` is MindSpore's scheduler port, as msrun's ``--master_port``. The
    controller listens on ``MS_TFT_PORT`` when the user set it (where MindSpore's own
    controller listens under msrun), else on ``--master-port`` + 1. Without a port on one
    node both are free ports; on several nodes ``--master-port`` defaults to 29600.
    """
    if not master_port:
        master_port = MULTI_NODE_MASTER_PORT if nnodes > 1 else None
    if master_port is not None and master_port < 1024:
        raise UsageError(f"--master-port {master_port} must be in 1024..65535")
    if master_port is None:
        scheduler_port = free_port_pair(master_ip) if scheduler else None
        return scheduler_port, tft_port or 0
    if tft_port is None and master_port == 65535:
        raise UsageError("--master-port 65535 leaves no port for the controller (--master-port + 1); "
                         "use 1024..65534 or set MS_TFT_PORT")
    controller_port = tft_port or master_port + 1
    if scheduler and controller_port == master_port:
        raise UsageError(f"MS_TFT_PORT {tft_port} is also --master-port, MindSpore's scheduler port: "
                         f"give the controller another port")
    return (master_port if scheduler else None), controller_port


def _check_ports_free(ip: str, scheduler_port: Optional[int], controller_port: int, mindio: bool,
                      tft_port: Optional[int]) -> None:
    """Refuse a launch whose servers on node 0 would find their port taken, before anything starts
    (a taken port otherwise shows only as a bind error deep in a log)."""
    controller_fix = "choose another MS_TFT_PORT" if tft_port else "choose another --master-port"
    wanted = []
    if scheduler_port is not None:
        wanted.append((scheduler_port, "MindSpore's scheduler port (--master-port)", "choose another --master-port"))
    if controller_port:
        wanted.append((controller_port, "the controller's port", controller_fix))
        if mindio:
            wanted.append((controller_port + 1, "the step gate's port (the controller's + 1)", controller_fix))
    for port, what, fix in wanted:
        problem = port_in_use(ip, port)
        if problem is not None:
            raise UsageError(f"port {port} on {ip}, {what}, is in use{problem}; {fix}")


def metrics_default_ip(master_ip: str) -> str:
    """Where a node other than 0 serves its metrics by default: the address it reaches node 0 from,
    the one its replica keeper binds (it has no --master-addr of its own)."""
    return node_ip(master_ip)


def _check_metrics_port(ip: str, port: int, taken: dict[int, str]) -> None:
    """Refuse a metrics port that node 0's other servers use (``taken``: port → whose) or that is in use."""
    if port in taken:
        raise UsageError(f"--metrics-port {port} is also {taken[port]}; choose another --metrics-port")
    problem = port_in_use(ip, port)
    if problem is not None:
        raise UsageError(f"port {port} on {ip}, the metrics port (--metrics-port), is in use{problem}; "
                         f"choose another --metrics-port")


def plan_launch(params: Mapping[str, Any], environ: Mapping[str, str]) -> LaunchSpec:
    """The launch the command line (click's parameters of :func:`main`) and environment ask for.

    Validates everything and has no side effect: the run directory (when not given) and
    the job key are made afterwards by :func:`main`. Raises :class:`UsageError` or
    :class:`~mindft.config.ConfigError`.
    """
    elastic = parse_node_range(str(params["nnodes"] or ""), "--nnodes")
    nproc, nnodes = resolve_world(params["nproc"], elastic[1] if elastic else None, params["worker_num"])
    elastic = elastic if elastic is not None and elastic[0] < elastic[1] else None
    node_rank, spare = params["node_rank"], params.get("spare", False)
    if spare and node_rank is not None:
        raise UsageError(f"--spare takes no --node-rank (got {node_rank}): a spare becomes whichever node is lost")
    if spare and nnodes < 2:
        raise UsageError("--spare needs a job on several nodes (--nnodes 2 or more): a spare takes a lost node's "
                         "place, and a one-node job loses its controller with its only node")
    if spare:
        node_rank = -1
    elif node_rank is None or node_rank == -1:
        if nnodes > 1 and node_rank == -1:
            raise UsageError("--node_rank -1 (msrun's automatic rank assignment) is not supported on "
                             "several nodes: mindft restarts ranks by their number; give each node's index")
        node_rank = 0
    if node_rank >= nnodes:
        raise UsageError(f"--node-rank {node_rank} must be below the number of nodes {nnodes}")
    command = _training_command(params["script"], params["script_args"])
    master_ip = resolve_ip(params["master_addr"])
    base = load_config(environ)  # validates the user's MS_ENABLE_TFT and MINDFT_* before starting anything
    check_launchable(base)
    scheduler = params["scheduler"]
    if scheduler and node_rank == 0 and importlib.util.find_spec("mindspore") is None:
        raise UsageError(f"MindSpore's scheduler needs mindspore, which {sys.executable} cannot import; "
                         f"install it, or pass --no-scheduler if the script never calls "
                         f"mindspore.communication.init()")
    tft_port = base.controller_port if "MS_TFT_PORT" in environ else None
    scheduler_port, controller_port = resolve_ports(params["master_port"], nnodes, master_ip, scheduler, tft_port)
    protected = base.tft.enabled
    mindio, max_restarts = False, params["max_restarts"]
    if protected:
        choice = choose_backend(base, importlib.util.find_spec("mindio_ttp") is not None,
                                lambda: "Ascend" if ascend_present() else "CPU")
        mindio = choice.backend == "mindio"
        log.info("fault-tolerance backend: %s (%s)", choice.backend, choice.reason)
    standbys = params.get("standbys", 0)
    if standbys and (not protected or mindio):
        raise UsageError("--standbys needs mindft's controller: fault tolerance on (MS_ENABLE_TFT) and the mindft "
                         "backend (MINDFT_BACKEND), not MindIO's")
    if standbys >= nnodes:
        raise UsageError(f"--standbys {standbys} needs more nodes than that (--nnodes {nnodes}): nodes "
                         f"1..{standbys} stand by for node 0's controller")
    if elastic and (not protected or mindio):
        raise UsageError(f"--nnodes {elastic[0]}:{elastic[1]} needs mindft's controller: fault tolerance on "
                         f"(MS_ENABLE_TFT) and the mindft backend (MINDFT_BACKEND), not MindIO's")
    if spare and (not protected or mindio):
        raise UsageError("--spare needs mindft's controller: fault tolerance on (MS_ENABLE_TFT) and the mindft "
                         "backend (MINDFT_BACKEND), not MindIO's")
    if protected and not mindio and base.tft.needs_mindio and command[0] == sys.executable:
        # MindSpore's own TrainFaultTolerance (MindFormers' Trainer appends it) would need MindIO TFT.
        command = (sys.executable, "-m", "mindft.mindspore.mindspore_tft", *command[1:])
        log.info("MS_ENABLE_TFT=%s: the ranks start through mindft.mindspore.mindspore_tft, which serves "
                 "MindSpore's TrainFaultTolerance on mindft (no MindIO)", base.tft)
    if mindio and max_restarts:
        log.warning("MindIO TFT cannot restart a killed rank from memory without MindCluster's ARF: "
                    "restarts are off (was --max-restarts %d); a lost rank ends the job with dying-gasp "
                    "checkpoints (exit 3 on the live ranks)", max_restarts)
        max_restarts = 0
    if mindio and controller_port == 0:
        controller_port = free_port_pair(master_ip)  # MindIO's controller cannot pick its own port
    if node_rank == 0:
        _check_ports_free(master_ip, scheduler_port, controller_port if protected else 0, mindio, tft_port)
    metrics_port = params["metrics_port"]
    metrics_ip = (resolve_ip(params["metrics_addr"], "--metrics-addr") if params["metrics_addr"]
                  else metrics_default_ip(master_ip) if node_rank and metrics_port is not None else master_ip)
    if metrics_port is not None and protected and not mindio:
        taken = {port: what for port, what in ((scheduler_port, "MindSpore's scheduler port (--master-port)"),
                                              (controller_port, "the controller's port")) if port}
        _check_metrics_port(metrics_ip, metrics_port, taken if node_rank == 0 else {})
    insecure = (params["insecure"] or base.insecure) and protected  # MINDFT_INSECURE=1 is --insecure
    key_file = params["key_file"] if protected and not insecure else None
    if protected and nnodes > 1 and key_file is None and not insecure:
        raise UsageError("a job on several nodes needs one key on every node: create it with "
                         "'mindft keygen keys.json', distribute it and pass --key-file keys.json (or --insecure)")
    if key_file is not None:
        load_keys(key_file)
    env = dict(environ)
    env.setdefault("MINDFT_RESET_FILE", str(base.reset_file))
    if standbys:
        env["MINDFT_STANDBYS"] = str(standbys)  # the controllers' and the ranks' (their patience)
    if elastic:  # the controller's (when to shrink) and the ranks' (whether their data path allows it)
        env["MINDFT_ELASTIC"] = f"{elastic[0]}:{elastic[1]}"
        if params.get("shrink_after") is not None:
            env["MINDFT_SHRINK_AFTER"] = f"{params['shrink_after']:g}"
        rules = load_config(env)
        waited = rules.shrink_after + silent_after(rules.timeouts.dead_after)
        if waited >= rules.timeouts.repair:
            raise UsageError(f"--shrink-after {rules.shrink_after:g}: a lost node would be waited for {waited:g} s, "
                             f"past MINDFT_REPAIR_TIMEOUT ({rules.timeouts.repair:g} s), when the job ends instead; "
                             f"give a shorter --shrink-after or a longer MINDFT_REPAIR_TIMEOUT")
    run_dir = params["run_dir"] or Path()
    return LaunchSpec(command=command, nproc=nproc, nnodes=nnodes, node_rank=node_rank, master_ip=master_ip,
                      controller_port=controller_port, scheduler_port=scheduler_port,
                      cluster_time_out=params["cluster_time_out"], max_restarts=max_restarts,
                      run_dir=run_dir, log_dir=params["log_dir"] or run_dir / "logs", key_file=key_file,
                      insecure=insecure, grace_period=params["grace_period"],
                      progress_interval=params["progress_interval"], env=env,
                      prefix_output=not params["no_prefix"], protected=protected, mindio=mindio,
                      console_mindspore_logs=params.get("console_mindspore_logs", False),
                      metrics_port=metrics_port, metrics_ip=metrics_ip, spare=spare, standbys=standbys,
                      master_addr=params["master_addr"])
