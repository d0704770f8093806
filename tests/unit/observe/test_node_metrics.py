"""A node agent's own metrics (mindft.observe.metrics.NodeCollector): read from a real NodePolicy, a state
directory with snapshot files, and stand-ins for the replication and the warm process; served on
node 0 with the controller's, and alone (``/metrics`` only) on the other nodes."""
from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from harness import FAKE_RANK, free_port
from mindft.agent.services import serve_node_metrics
from mindft.config import ConfigError, MindftConfig
from mindft.flow.agent import NodePolicy
from mindft.cli.launch import main
from mindft.agent.plan import LaunchSpec, UsageError, plan_launch
from mindft.observe.metrics import MetricsServer, NodeCollector
from mindft.protocol import OrderKind, RankOrder


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: Samples, name: str, **labels: str) -> Optional[float]:
    return found.get((name, tuple(sorted(labels.items()))))


def _policy() -> NodePolicy:
    """Node 1's policy (ranks 2 and 3) after rank 3 was killed and restarted on the controller's order."""
    policy = NodePolicy((2, 3), 3, protected=True, reports=True, runs_controller=False)
    policy.started(2, 100)
    policy.started(3, 101)
    policy.on_exit(3, -9)
    policy.on_order(RankOrder(3, OrderKind.START, "restart"))
    policy.started(3, 102)
    return policy


def _registry(collector: NodeCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_restarts_are_read_from_the_policy_per_rank() -> None:
    found = samples(_registry(NodeCollector(1, _policy())))
    assert value(found, "mindft_node_rank_restarts_total", node="1", rank="3") == 1
    assert value(found, "mindft_node_rank_restarts_total", node="1", rank="2") == 0
    assert value(found, "mindft_node_rank_restarts_used", node="1", rank="3") == 1
    assert value(found, "mindft_node_max_restarts", node="1") == 3
    # Parts the agent does not have (yet): no series, rather than a made-up 0.
    assert not [key for key in found if key[0].startswith(("mindft_node_snapshot", "mindft_node_replica",
                                                            "mindft_node_warm", "mindft_node_shared"))]


def test_snapshot_bytes_are_the_files_in_the_agents_memory(tmp_path: Path) -> None:
    for rank, size in ((2, 1000), (3, 3000)):
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "slot0.bin").write_bytes(b"x" * size)
        (tmp_path / f"rank{rank}" / "slot0.json").write_bytes(b"{}")
    (tmp_path / "replicas").mkdir()
    (tmp_path / "replicas" / "rank1.bin").write_bytes(b"y" * 500)  # the keeper's: shared memory, no rank's own
    collector = NodeCollector(1, _policy())
    collector.state_dir = tmp_path
    found = samples(_registry(collector))
    assert value(found, "mindft_node_snapshot_bytes", node="1", rank="2") == 1002
    assert value(found, "mindft_node_snapshot_bytes", node="1", rank="3") == 3002
    assert value(found, "mindft_node_shared_memory_bytes", node="1") == 1002 + 3002 + 500


def test_replication_and_warm_start_are_read_from_their_objects() -> None:
    sender = SimpleNamespace(pushes=7, sent_bytes=70_000, replicated={2: 40, 3: -1})
    keeper = SimpleNamespace(received_bytes=65_000, held={0: 38, 1: 40}, nbytes=64_000)
    collector = NodeCollector(1, _policy(), warm=SimpleNamespace(available=True, forked=3, pid=os.getpid()))
    collector.replication = SimpleNamespace(sender=sender, keeper=keeper, cpu=SimpleNamespace(seconds=lambda: 1.5))
    found = samples(_registry(collector))
    assert value(found, "mindft_node_replica_pushes_total", node="1") == 7
    assert value(found, "mindft_node_replica_sent_bytes_total", node="1") == 70_000
    assert value(found, "mindft_node_replica_received_bytes_total", node="1") == 65_000
    assert value(found, "mindft_node_replicated_step", node="1", rank="2") == 40
    assert value(found, "mindft_node_replicated_step", node="1", rank="3") is None  # none confirmed yet
    assert value(found, "mindft_node_replica_held_step", node="1", rank="0") == 38
    assert value(found, "mindft_node_replica_held_bytes", node="1") == 64_000
    assert value(found, "mindft_node_replication_cpu_seconds_total", node="1") == 1.5
    assert value(found, "mindft_node_warm_start_available", node="1") == 1
    assert value(found, "mindft_node_warm_forks_total", node="1") == 3
    assert value(found, "mindft_node_warm_pss_bytes", node="1") > 0  # this process's, as a stand-in

    collector.warm = SimpleNamespace(available=False, forked=3, pid=os.getpid())  # fell back to cold starts
    collector.replication.cpu = SimpleNamespace(seconds=lambda: None)  # no /proc
    found = samples(_registry(collector))
    assert value(found, "mindft_node_warm_start_available", node="1") == 0
    assert value(found, "mindft_node_warm_pss_bytes", node="1") is None
    assert value(found, "mindft_node_replication_cpu_seconds_total", node="1") is None


def test_node_0_serves_its_own_metrics_with_the_controllers_on_one_port() -> None:
    from mindft.agent.links import ControllerHost

    policy = NodePolicy((0,), 2, protected=True, reports=True, runs_controller=True)
    host = ControllerHost(MindftConfig(world_size=1, controller_port=0, insecure=True),
                          metrics_at=("127.0.0.1", free_port()), node_metrics=NodeCollector(0, policy))
    host.start()
    try:
        with urllib.request.urlopen(host.metrics_server.url, timeout=5) as answer:
            names = {f.name for f in text_string_to_metric_families(answer.read().decode())}
        assert {"mindft_job_state", "mindft_node_rank_restarts", "mindft_node_max_restarts"} <= names
    finally:
        host.stop()


def _spec(port: int) -> LaunchSpec:
    return LaunchSpec(command=("true",), nproc=1, nnodes=2, node_rank=1, master_ip="127.0.0.1", controller_port=0,
                      scheduler_port=None, metrics_port=port, metrics_ip="127.0.0.1")


def test_another_node_serves_its_metrics_alone_and_points_to_node_0_for_the_page() -> None:
    server = serve_node_metrics(_spec(free_port()), NodeCollector(1, _policy()))
    try:
        with urllib.request.urlopen(server.url, timeout=5) as answer:
            names = {f.name for f in text_string_to_metric_families(answer.read().decode())}
        assert "mindft_node_rank_restarts" in names and "mindft_job_state" not in names  # no controller here
        page = server.url.removesuffix("metrics")
        with urllib.request.urlopen(page, timeout=5) as answer:
            assert "status page is served by node 0's agent" in answer.read().decode()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(page + "status.json", timeout=5)
    finally:
        server.close()


def test_a_taken_port_on_another_node_is_a_configuration_error() -> None:
    taken = MetricsServer(CollectorRegistry(), "127.0.0.1", free_port())
    try:
        with pytest.raises(ConfigError, match=f"port {taken.port} on 127.0.0.1, the metrics port, cannot be bound"):
            serve_node_metrics(_spec(taken.port), NodeCollector(1, _policy()))
    finally:
        taken.close()


def _plan_node_1(*argv: str) -> LaunchSpec:
    params = main.make_context("mindft-launch", ["--nnodes", "2", "--node-rank", "1", "--insecure", *argv,
                                                 "--no-scheduler", str(FAKE_RANK)]).params
    return plan_launch(params, {"MS_ENABLE_TFT": "{RSC:1}"})


def test_another_node_serves_on_the_address_it_reaches_node_0_from_and_checks_its_port() -> None:
    port = free_port()
    assert _plan_node_1("--metrics-port", str(port)).metrics_ip == "127.0.0.1"  # node 0 on loopback: loopback
    assert _plan_node_1("--metrics-port", str(port), "--metrics-addr", "0.0.0.0").metrics_ip == "0.0.0.0"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(UsageError, match=f"port {taken} on 127.0.0.1, the metrics port"):
            _plan_node_1("--metrics-port", str(taken))
