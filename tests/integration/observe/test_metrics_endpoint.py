"""mindft-launch --metrics-port, scraped over HTTP as Prometheus would while a real 2-rank job
recovers from a killed rank; the exposition read back by prometheus_client's own parser."""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import free_port
from launching import Job

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample at http://127.0.0.1:PORT/metrics: (name, sorted labels) → value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), float("nan"))


def test_scraped_metrics_follow_a_recovery(launch: Callable[..., Job]) -> None:  # noqa: F811
    port = free_port()
    job = launch(nproc=2, steps=200, step_time=0.04, args=("--no-scheduler", "--metrics-addr", "127.0.0.1"),
                 MINDFT_METRICS_PORT=str(port), LAUNCH_CRASH="1:40", LAUNCH_COST="0.04:0.001")
    seen: list[Samples] = []

    def scraped(condition: Callable[[Samples], bool]) -> Callable[[], bool]:
        def check() -> bool:
            seen.append(scrape(port))
            return condition(seen[-1])
        return check

    job.wait_until(scraped(lambda s: value(s, "mindft_job_state", state="NORMAL") == 1
                           and value(s, "mindft_job_step") >= 1), "training, seen by a scrape")
    before = seen[-1]
    recovered = {"kind": "process_died", "rung": "in_place"}
    assert value(before, "mindft_recoveries_total", **recovered) == 0, "scraped too late: the fault had come"
    assert value(before, "mindft_ranks", state="running") == 2
    assert value(before, "mindft_snapshot_every_steps") >= 1

    job.wait_until(scraped(lambda s: value(s, "mindft_recoveries_total", **recovered) >= 1
                           and value(s, "mindft_job_state", state="NORMAL") == 1), "the recovery, seen by a scrape")
    after = seen[-1]
    assert value(after, "mindft_recoveries_total", **recovered) == 1
    assert value(after, "mindft_recovery_seconds_count") == 1 and value(after, "mindft_recovery_seconds_sum") > 0
    for phase in ("detect", "pause", "repair", "rollback", "resume"):
        assert value(before, "mindft_recovery_phase_seconds_count", phase=phase) == 0
        assert value(after, "mindft_recovery_phase_seconds_count", phase=phase) == 1, phase
    # Its process died after the last step it reported: detected from then on, by its agent's report.
    assert value(after, "mindft_recovery_phase_seconds_sum", phase="detect") > 0
    # No rank was told to leave a chip (no hot reset here): the series exists, nothing observed.
    assert value(after, "mindft_recovery_phase_seconds_count", phase="leave") == 0
    # What the ranks said a step costs them (LAUNCH_COST, for the cadence): seconds per step.
    assert value(after, "mindft_step_duration_seconds") == pytest.approx(0.04)
    # The rank restarted for the recovery: its process had died, a new one registered and trains.
    assert value(after, "mindft_recovery_phase_seconds_sum", phase="repair") > 0
    assert value(after, "mindft_recovery_lost_steps_count") == 1
    assert value(after, "mindft_ranks", state="running") + value(after, "mindft_ranks", state="done") == 2
    assert all(value(after, "mindft_ranks", state=state) == 0 for state in ("dead", "faulty", "paused", "lost"))
    assert value(after, "mindft_dying_gasps_total") == 0

    assert job.wait() == 0, job.text()
    assert f"metrics http://127.0.0.1:{port}/metrics" in job.text()
    job.assert_bit_identical()
    with pytest.raises(urllib.error.URLError):  # stopped with the controller: the port is let go
        scrape(port)
