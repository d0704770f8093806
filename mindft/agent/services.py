"""What a node agent runs beside its ranks: the warm process (every node), the job's controller
and the reset-file watcher (node 0, :class:`~mindft.agent.links.ControllerHost`), MindIO's
controller and step gate (node 0 of a job MindIO coordinates) and the node's own metrics server
(the other nodes; node 0 serves its metrics with the controller's).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

from mindft.agent.links import ControllerHost
from mindft.agent.plan import LaunchSpec, rank_environment
from mindft.agent.warm import WarmStarter
from mindft.config import MINDX_TASK_VARIABLE, MindftConfig, load_config
from mindft.flow.agent import NodePolicy
from mindft.observe.events import CONTROLLER_FILE, EventLog
from mindft.protocol import Message, OrderKind, RankOrder

log = logging.getLogger(__name__)


def start_warm(spec: LaunchSpec) -> Optional[WarmStarter]:
    """The node's warm process, importing what MINDFT_PRELOAD names while the agent gets ready;
    None with MINDFT_WARM_START=0."""
    config = load_config(spec.env)
    if not config.warm_start:
        return None
    # The workers' interpreter settings (rank_environment's PYTHONUNBUFFERED): a fork keeps them.
    return WarmStarter({**spec.env, "PYTHONUNBUFFERED": "1"}, spec.log_dir / "warm.log", config.preload)


def controller_config(spec: LaunchSpec) -> MindftConfig:
    """The controller's configuration: the environment, with the launcher's address and keys."""
    env = rank_environment(spec, spec.local_ranks[0], 0)
    env.update({"MS_NODE_ID": "0", "RANK_ID": "0", "MS_TFT_PORT": str(spec.controller_port or 29600)})
    # Port 0 (not a valid MS_TFT_PORT) lets the controller bind a free port itself.
    return dataclasses.replace(load_config(env), controller_port=spec.controller_port)


def host_controller(spec: LaunchSpec, node_metrics: Optional[Any], deliver: Callable[[Message], None],
                    standby_term: Optional[int] = None, supersedes: str = "") -> ControllerHost:
    """Node 0: the job's controller (bound; serving the metrics too with ``--metrics-port``),
    its event log, and this node's agent attached in-process, its orders and views handed to
    ``deliver``; started. With port 0 the controller chose its port: the host's ``port``.
    ``standby_term``: a standby's controller on this node, for that term, which took over from the
    controller at ``supersedes`` (the node's own metrics server must be closed first: this one
    serves them with the job's, and the status page)."""
    runner = ControllerHost(controller_config(spec), metrics_at=None if spec.metrics_port is None
                            else (spec.metrics_ip, spec.metrics_port), run_dir=spec.run_dir,
                            node_metrics=node_metrics, node=spec.node_rank,
                            standby_term=standby_term, supersedes=supersedes)
    runner.controller.events = EventLog(spec.run_dir / CONTROLLER_FILE, "controller")
    runner.controller.attach_agent(spec.node_rank, tuple(spec.local_ranks), deliver)
    runner.start()
    return runner


def start_mindio(spec: LaunchSpec, keys: Any, policy: NodePolicy,
                 deliver: Callable[[Message], None]) -> Optional[Any]:
    """Node 0 runs MindIO's controller and the step gate (a started :class:`mindft.mindio.MindioHost`),
    unless MindCluster runs the controller (None)."""
    from mindft.mindio import MindioHost, controller_runs_here

    if not controller_runs_here(spec.node_rank, spec.env):
        log.info("%s is set: MindCluster runs MindIO's controller; no step gate", MINDX_TASK_VARIABLE)
        return None
    config = controller_config(spec)
    timeouts = config.timeouts

    def alive(rank: int) -> bool:
        return policy.workers.get(rank) is not None and policy.workers[rank].pid is not None

    # Node 0 plays MindCluster's MindX for MindIO's controller: the reset file's hot resets go
    # through MindIO's ARF; its kills and starts are orders like the controller's.
    standin = dict(kill=lambda rank, why: deliver(RankOrder(rank, OrderKind.KILL, why)),
                   start=lambda rank, why: deliver(RankOrder(rank, OrderKind.START, why)),
                   alive=alive, leave_timeout=timeouts.leave, gather_timeout=timeouts.pause,
                   repair_timeout=timeouts.repair)
    host = MindioHost(spec.world_size, spec.master_ip, spec.controller_port, keys, gate_port=spec.controller_port + 1,
                      reset_file=config.reset_file, poll_interval=timeouts.reset_poll_interval, standin=standin)
    host.start()
    return host


def serve_node_metrics(spec: LaunchSpec, collector: Any) -> Any:
    """A node other than 0: its own metrics at ``--metrics-addr:--metrics-port``, ``/metrics`` only
    (the status page is the controller's, on node 0). A taken port is a configuration error."""
    from prometheus_client import CollectorRegistry

    from mindft.observe.metrics import MetricsServer

    registry = CollectorRegistry()
    registry.register(collector)
    host = f"[{spec.master_ip}]" if ":" in spec.master_ip else spec.master_ip
    elsewhere = (f"mindft node {spec.node_rank}: this node agent's metrics are at /metrics; the job's status page "
                 f"is served by node 0's agent, with the controller: http://{host}:PORT/ (PORT: node 0's "
                 f"--metrics-port)")
    return MetricsServer(registry, spec.metrics_ip, spec.metrics_port, elsewhere=elsewhere)
