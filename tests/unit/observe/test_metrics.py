"""The controller's metrics (mindft.observe.metrics) from a flow Job driven message by message: no sockets,
no threads; read back through prometheus_client's own parser of the exposition format."""
from __future__ import annotations

import os
import socket
import time
import urllib.request
from typing import Optional

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from harness import FAKE_RANK, free_port, free_port_pair
from mindft.config import ConfigError, MindftConfig, Timeouts
from mindft.exitcodes import ExitCode
from mindft.flow import DeviceFaulty, DeviceRecovered, Job, JobState, ProcessExited, Transition
from mindft.cli.launch import main
from mindft.agent.plan import LaunchSpec, UsageError, plan_launch
from mindft.observe.metrics import FAULT_KINDS, JobMetrics, MetricsServer
from mindft.rank.processor import Processor
from mindft.protocol import (Ack, ActionKind, CostReport, FaultKind, FaultReport, Heartbeat, NodeLost, Pace,
                             ProcessExit, Register, ReplicaReport, StepReport)

T = Timeouts(heartbeat_interval=1.0, heartbeat_misses=3, register=10.0, pause=5.0, repair=20.0, rollback=5.0,
             resume=5.0, leave=8.0)


class Driver:
    """A Job, its metrics fed with every Transition it emits (as the controller's shell does),
    and a clock the test moves."""

    def __init__(self, world: int = 2, every: int = 1, restart_scope: str = "rank") -> None:
        self.now = 0.0
        self.job = Job(world, T, self.now, snapshot_every=every, restart_scope=restart_scope)
        self.world = world
        self.metrics = JobMetrics()
        self.metrics.watch(lambda: self.job.status(self.now))

    def send(self, rank: int, message, incarnation: int = 0) -> None:
        self.feed(self.job.handle(f"rank{rank}.inc{incarnation}".encode(), message, self.now))

    def feed(self, effects: list) -> None:
        for effect in effects:
            if isinstance(effect, Transition):
                self.metrics.transition(self.job, effect)

    def start(self) -> Driver:
        for rank in range(self.world):
            self.send(rank, Register(rank, 0, 100 + rank, (0,)))
        return self

    def steps(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            for rank in range(self.world):
                self.send(rank, StepReport(rank, step))

    def ack_all(self, kind: ActionKind, step: int, held: tuple[int, ...], incarnation: int = 0) -> None:
        for rank in range(self.world):
            self.send(rank, Ack(rank, kind, step, held, self.job.recovery.round), incarnation)

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of the exposition, parsed back: (name, sorted labels) → value."""
        text = generate_latest(self.metrics.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def value(self, name: str, **labels: str) -> Optional[float]:
        return self.samples().get((name, tuple(sorted(labels.items()))))


def _recover_from_uce(d: Driver, fault_step: int = 6) -> None:
    """Rank 1 reports a UCE in ``fault_step``; pausing, rolling back and resuming take a second each
    (a UCE needs nothing external: the repair takes no time)."""
    d.send(1, FaultReport(1, fault_step, FaultKind.UCE, "injected"))
    assert d.job.state is JobState.PAUSING
    d.now += 1.0
    d.ack_all(ActionKind.PAUSE, fault_step - 1, (fault_step - 2, fault_step - 1))
    assert d.job.state is JobState.ROLLBACK
    d.now += 1.0
    d.ack_all(ActionKind.ROLLBACK, fault_step - 1, (fault_step - 2, fault_step - 1))
    assert d.job.state is JobState.RESUMING
    d.now += 1.0
    d.ack_all(ActionKind.RESUME, fault_step - 1, (fault_step - 2, fault_step - 1))
    assert d.job.state is JobState.NORMAL


def test_status_gauges_show_the_job_and_its_ranks() -> None:
    d = Driver(world=2, every=1)
    assert d.value("mindft_job_state", state="STARTING") == 1.0
    assert d.value("mindft_ranks", state="registered") == 0.0
    d.send(0, Register(0, 0, 100, (0,)))
    assert d.value("mindft_ranks", state="registered") == 1.0
    d.send(1, Register(1, 0, 101, (0,)))
    d.steps(1, 7)
    assert d.value("mindft_job_state", state="NORMAL") == 1.0
    assert d.value("mindft_job_state", state="STARTING") == 0.0
    assert d.value("mindft_job_step") == 7.0
    assert d.value("mindft_ranks", state="running") == 2.0
    assert d.value("mindft_snapshot_every_steps") == 1.0
    assert d.value("mindft_snapshot_over_budget") == 0.0
    assert d.value("mindft_snapshot_overhead_ratio") is None  # no rank reported its costs
    # No agent reported a replica: no lag, and no LOST PROTECTION yet.
    assert d.value("mindft_rank_replica_lag_steps", rank="0") is None
    assert d.value("mindft_rank_lost_protection", rank="1") == 0.0
    d.send(0, ReplicaReport(node=1, ranks=(0, 1), steps=(5, 7)))
    assert d.value("mindft_rank_replica_lag_steps", rank="0") == 2.0
    assert d.value("mindft_rank_replica_lag_steps", rank="1") == 0.0


def test_the_jobs_wall_time_is_exported_by_bucket_and_its_goodput_ratio() -> None:
    d = Driver(world=2)
    d.now = 2.0
    d.start()  # 2 s of start-up
    d.steps(1, 5)
    _recover_from_uce(d)  # 3 s of recovery phases
    d.now += 5.0
    buckets = {labels[0][1]: value for (name, labels), value in d.samples().items()
               if name == "mindft_job_seconds_total"}
    assert buckets["start-up"] == pytest.approx(2.0) and buckets["pause"] + buckets["rollback"] + buckets["resume"] > 0
    assert sum(buckets.values()) == pytest.approx(d.now)  # every second counted once
    assert d.value("mindft_goodput_ratio") == pytest.approx(buckets["productive"] / d.now)


def test_a_slow_rank_is_exported_with_every_ranks_work_ratio() -> None:
    d = Driver(world=3).start()
    assert d.value("mindft_rank_slow", rank="2") == 0.0 and d.value("mindft_rank_work_ratio", rank="2") is None
    for number in range(1, 4):  # three windows of 30 s (the defaults), rank 2 twice as slow
        d.now = 30.0 * number - 0.5
        for rank in range(3):
            d.send(rank, Pace(rank, 50, 0.2 if rank == 2 else 0.1))
        d.feed(d.job.tick(30.0 * number))
    assert d.value("mindft_rank_slow", rank="2") == 1.0 and d.value("mindft_rank_slow", rank="0") == 0.0
    assert d.value("mindft_rank_work_ratio", rank="2") == 2.0
    assert d.value("mindft_rank_work_ratio", rank="0") == pytest.approx(0.667)


def test_a_recovery_is_counted_with_its_kind_rung_phases_and_lost_steps() -> None:
    d = Driver(world=2).start()
    d.steps(1, 5)
    assert d.value("mindft_recoveries_total", kind="uce", rung="in_place") == 0.0  # exists before the first
    _recover_from_uce(d)
    assert d.value("mindft_recoveries_total", kind="uce", rung="in_place") == 1.0
    assert d.value("mindft_recovery_seconds_count") == 1.0
    assert d.value("mindft_recovery_seconds_sum") == pytest.approx(3.0)
    for phase, seconds in (("pause", 1.0), ("repair", 0.0), ("rollback", 1.0), ("resume", 1.0)):
        assert d.value("mindft_recovery_phase_seconds_count", phase=phase) == 1.0
        assert d.value("mindft_recovery_phase_seconds_sum", phase=phase) == pytest.approx(seconds), phase
    # The fastest rank had finished step 5, every rank rolled back to 5: nothing to train again.
    assert d.value("mindft_recovery_lost_steps_count") == 1.0
    assert d.value("mindft_recovery_lost_steps_sum") == 0.0
    assert d.value("mindft_ranks", state="running") == 2.0
    assert d.value("mindft_dying_gasps_total") == 0.0


def test_steps_lost_are_the_newest_finished_step_minus_the_rollback_step() -> None:
    d = Driver(world=2, every=4).start()
    d.steps(1, 6)  # snapshots at 4 (and 0): a fault in step 7 rolls back to 4
    d.send(1, FaultReport(1, 7, FaultKind.COMMUNICATION, "link"))
    d.ack_all(ActionKind.PAUSE, 6, (0, 4))
    d.ack_all(ActionKind.ROLLBACK, 4, (0, 4))
    d.ack_all(ActionKind.RESUME, 4, (0, 4))
    assert d.job.state is JobState.NORMAL
    assert d.value("mindft_recoveries_total", kind="communication", rung="in_place") == 1.0
    assert d.value("mindft_recovery_lost_steps_sum") == 2.0
    assert d.value("mindft_recovery_lost_steps_bucket", le="2.0") == 1.0
    assert d.value("mindft_recovery_lost_steps_bucket", le="1.0") == 0.0


def test_restarting_every_worker_is_the_second_rung() -> None:
    d = Driver(world=2, restart_scope="all").start()
    d.steps(1, 3)
    d.send(0, ProcessExit(1, -9, 101, will_restart=True))  # a process died where collectives cannot be repaired
    assert d.job.recovery.restart_all
    d.send(0, ProcessExit(0, -15, 100, will_restart=True))  # (killed by its agent, as ordered)
    for rank in range(2):
        d.send(rank, Register(rank, 1, 200 + rank, (2, 3)), incarnation=1)
    d.ack_all(ActionKind.ROLLBACK, 3, (2, 3), incarnation=1)
    d.ack_all(ActionKind.RESUME, 3, (2, 3), incarnation=1)
    assert d.job.state is JobState.NORMAL
    assert d.value("mindft_recoveries_total", kind="process_died", rung="restart_all") == 1.0
    assert d.value("mindft_recoveries_total", kind="process_died", rung="in_place") == 0.0


def test_a_failed_job_counts_its_dying_gasp_and_the_recovery_that_gave_up() -> None:
    d = Driver(world=2).start()
    d.steps(1, 3)
    d.send(1, FaultReport(1, 4, FaultKind.UCE, "injected"))
    d.send(0, ProcessExit(0, 1, 100, will_restart=False))  # while it pauses: nothing to recover it with
    assert d.job.state is JobState.FAILED
    assert d.value("mindft_dying_gasps_total") == 1.0
    assert d.value("mindft_recoveries_total", kind="uce", rung="dying_gasp") == 1.0
    assert d.value("mindft_recovery_seconds_count") == 0.0  # it did not complete
    assert d.value("mindft_job_state", state="FAILED") == 1.0


def test_a_lost_node_no_replica_can_replace_takes_the_dying_gasp_at_once() -> None:
    d = Driver(world=2).start()
    d.steps(1, 3)
    d.send(0, NodeLost(1, (1,), (-1,), (), "test"))  # (from node 1's new agent; nothing could be restored)
    assert d.job.state is JobState.FAILED
    assert d.value("mindft_recoveries_total", kind="node_lost", rung="dying_gasp") == 1.0
    assert d.value("mindft_dying_gasps_total") == 1.0


def test_a_job_that_fails_while_training_took_no_rung() -> None:
    d = Driver(world=2).start()
    d.send(0, ProcessExit(0, 1, 100, will_restart=False))
    assert d.job.state is JobState.FAILED
    assert d.value("mindft_dying_gasps_total") == 1.0
    assert sum(value for (name, _), value in d.samples().items() if name == "mindft_recoveries_total") == 0.0


def test_every_series_follows_the_naming_conventions() -> None:
    d = Driver(world=2).start()
    d.steps(1, 5)
    _recover_from_uce(d)
    names = {name for name, _ in d.samples()}
    assert all(name.startswith("mindft_") for name in names)
    text = generate_latest(d.metrics.registry).decode()
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert types["mindft_recoveries"] == "counter" and types["mindft_dying_gasps"] == "counter"
    assert types["mindft_recovery_phase_seconds"] == "histogram" and types["mindft_recovery_seconds"] == "histogram"
    assert types["mindft_ranks"] == "gauge" and types["mindft_job_step"] == "gauge"
    # rank is a label of the per-rank gauges only.
    with_rank = {name for name, labels in d.samples() if any(key == "rank" for key, _ in labels)}
    assert with_rank <= {"mindft_rank_replica_lag_steps", "mindft_rank_lost_protection", "mindft_rank_slow",
                         "mindft_rank_work_ratio"}
    kinds = {dict(labels)["kind"] for name, labels in d.samples() if name == "mindft_recoveries_total"}
    assert kinds == set(FAULT_KINDS)


def test_the_server_serves_the_registry_and_lets_go_of_its_port() -> None:
    d = Driver(world=2).start()
    server = MetricsServer(d.metrics.registry, "127.0.0.1", free_port())
    try:
        with urllib.request.urlopen(server.url, timeout=5) as answer:
            text = answer.read().decode()
        assert any(f.name == "mindft_job_state" for f in text_string_to_metric_families(text))
    finally:
        server.close()
    server.close()  # idempotent
    again = MetricsServer(d.metrics.registry, "127.0.0.1", server.port)  # the port was released
    again.close()


def test_a_taken_metrics_port_is_a_configuration_error() -> None:
    from mindft.agent.links import ControllerHost

    taken = MetricsServer(JobMetrics().registry, "127.0.0.1", free_port())
    try:
        with pytest.raises(ConfigError, match=f"port {taken.port} on 127.0.0.1, the metrics port, cannot be bound"):
            ControllerHost(MindftConfig(world_size=1, controller_port=0, insecure=True),
                           metrics_at=("127.0.0.1", taken.port))
    finally:
        taken.close()


def _plan(*argv: str) -> LaunchSpec:
    """What mindft-launch would run for ``argv`` (its own click command parses them)."""
    params = main.make_context("mindft-launch", [*argv, "--no-scheduler", str(FAKE_RANK)]).params
    return plan_launch(params, {"MS_ENABLE_TFT": "{RSC:1}"})


def test_metrics_are_off_unless_asked_and_served_on_the_master_address_by_default() -> None:
    assert _plan().metrics_port is None
    port = free_port()
    spec = _plan("--metrics-port", str(port))
    assert (spec.metrics_ip, spec.metrics_port) == ("127.0.0.1", port)
    assert _plan("--metrics-port", str(port), "--metrics-addr", "0.0.0.0").metrics_ip == "0.0.0.0"


def test_a_taken_or_shared_metrics_port_is_a_usage_error() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UsageError, match=f"port {port} on 127.0.0.1, the metrics port \\(--metrics-port\\), "
                                             f"is in use by pid {os.getpid()} .*; choose another --metrics-port"):
            _plan("--metrics-port", str(port))
    controller = free_port_pair()  # the check that follows needs P + 1 free too
    with pytest.raises(UsageError, match=f"--metrics-port {controller + 1} is also the controller's port"):
        _plan("--master-port", str(controller), "--metrics-port", str(controller + 1))


def test_a_controller_is_not_kept_alive_by_its_metrics() -> None:
    import gc
    import weakref

    from mindft.controller import Controller

    controller = Controller(MindftConfig(world_size=1, controller_port=0, insecure=True))
    registry, gone = controller.metrics.registry, weakref.ref(controller)
    controller.start()
    controller.stop()
    gc.disable()
    try:
        del controller
        assert gone() is None  # freed at once, by reference counting: no cycle through the registry
    finally:
        gc.enable()
    assert "mindft_job_state" not in generate_latest(registry).decode()  # its status left with it


def test_detect_is_the_age_a_rank_reports_with_its_fault() -> None:
    d = Driver(world=2).start()
    d.steps(1, 5)
    assert d.value("mindft_recovery_phase_seconds_count", phase="detect") == 0.0  # exists before the first
    d.send(1, FaultReport(1, 6, FaultKind.UCE, "injected", age=0.25))  # caught a quarter second before its report
    for kind in (ActionKind.PAUSE, ActionKind.ROLLBACK, ActionKind.RESUME):
        d.ack_all(kind, 5, (4, 5))
    assert d.job.state is JobState.NORMAL
    assert d.value("mindft_recovery_phase_seconds_count", phase="detect") == 1.0
    assert d.value("mindft_recovery_phase_seconds_sum", phase="detect") == pytest.approx(0.25)
    assert d.value("mindft_recovery_phase_seconds_bucket", phase="detect", le="0.25") == 1.0
    assert d.value("mindft_recovery_phase_seconds_bucket", phase="detect", le="0.1") == 0.0
    # No rank was told to leave its chip: no leave phase observed (a 0 would say it was instant).
    assert d.value("mindft_recovery_phase_seconds_count", phase="leave") == 0.0


def test_a_rank_reports_how_long_before_its_report_it_caught_the_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    processor = Processor(MindftConfig(rank=0, world_size=1, controller_port=free_port(), insecure=True))
    sent: list = []
    monkeypatch.setattr(processor, "send", sent.append)  # (nothing listens: the frame is looked at, not sent)
    try:
        processor.report_fault(FaultKind.UCE, "injected", 3, since=time.monotonic() - 0.5)
        processor.report_fault(FaultKind.UCE, "injected", 3)
    finally:
        processor.close()
    assert sent[0].age >= 0.5 and sent[1].age == 0.0


def test_detect_of_a_dead_rank_runs_from_the_last_message_the_job_had_from_it() -> None:
    d = Driver(world=2).start()
    d.steps(1, 5)  # at 0 s
    d.now = 0.75
    d.send(0, ProcessExit(1, -9, 101, will_restart=True))  # its agent saw it die: some time after step 5
    d.ack_all(ActionKind.PAUSE, 5, (4, 5))
    d.send(1, Register(1, 1, 201, (4, 5)), incarnation=1)
    for kind in (ActionKind.ROLLBACK, ActionKind.RESUME):
        for rank, incarnation in ((0, 0), (1, 1)):
            d.send(rank, Ack(rank, kind, 5, (4, 5), d.job.recovery.round), incarnation)
    assert d.job.state is JobState.NORMAL
    assert d.value("mindft_recovery_phase_seconds_sum", phase="detect") == pytest.approx(0.75)


def test_detect_of_a_silent_rank_includes_the_silence_before_it_was_declared_hung() -> None:
    d = Driver(world=2).start()
    d.steps(1, 5)  # rank 1 is last heard of at 0 s
    d.now = 2.0
    d.send(0, Heartbeat(0, 0, 5))
    d.now = 3.5  # past timeouts.dead_after (3 s) for rank 1 only
    d.feed(d.job.tick(d.now))
    assert d.job.state is JobState.PAUSING
    assert d.job.recovery.detect_seconds() == pytest.approx(3.5)


def test_leave_runs_from_the_order_to_leave_the_chip_to_the_last_exit() -> None:
    d = Driver(world=2).start()
    d.steps(1, 3)
    d.feed(d.job.device(DeviceFaulty(1, "0x8C03A000", "reset"), d.now))
    assert d.value("mindft_recovery_phase_seconds_sum", phase="detect") == 0.0  # (not yet: no recovery done)
    d.now += 1.0
    d.ack_all(ActionKind.PAUSE, 3, (2, 3))
    assert d.job.state is JobState.REPAIRING  # rank 1 is told to leave its chip now
    d.now += 0.5
    d.feed(d.job.process_exit(ProcessExited(1, ExitCode.LEFT_DEVICE, 101), d.now))
    d.now += 2.0  # the chip is reset, the rank starts again
    d.feed(d.job.device(DeviceRecovered(1), d.now))
    d.send(1, Register(1, 1, 201, (2, 3)), incarnation=1)
    for rank, incarnation in ((0, 0), (1, 1)):
        d.send(rank, Ack(rank, ActionKind.ROLLBACK, 3, (2, 3), d.job.recovery.round), incarnation)
    for rank, incarnation in ((0, 0), (1, 1)):
        d.send(rank, Ack(rank, ActionKind.RESUME, 3, (2, 3), d.job.recovery.round), incarnation)
    assert d.job.state is JobState.NORMAL
    assert d.value("mindft_recovery_phase_seconds_count", phase="leave") == 1.0
    assert d.value("mindft_recovery_phase_seconds_sum", phase="leave") == pytest.approx(0.5)
    assert d.value("mindft_recovery_phase_seconds_sum", phase="repair") == pytest.approx(2.5)
    assert d.value("mindft_recovery_phase_seconds_sum", phase="detect") == 0.0  # the watcher's event: at once


def test_step_time_is_the_slowest_ranks_smoothed_figure() -> None:
    d = Driver(world=2).start()
    d.steps(1, 3)
    assert d.value("mindft_step_duration_seconds") is None  # no rank reported its costs yet
    d.send(0, CostReport(0, 0.125, 0.01))
    assert d.value("mindft_step_duration_seconds") == 0.125
    d.send(1, CostReport(1, 0.5, 0.02))
    d.send(0, CostReport(0, 0.25, 0.01))
    assert d.value("mindft_step_duration_seconds") == 0.5  # a synchronous job goes at its slowest rank's pace
    assert d.job.status(d.now).step_time == 0.5  # (what the status page shows)
