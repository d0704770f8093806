"""The live status page: what it shows, the routes it answers, and that it needs nothing from elsewhere."""
from __future__ import annotations

import io
import json
import re

from prometheus_client import CollectorRegistry, Counter

from mindft.config import Timeouts
from mindft.flow import DeviceFaulty, Job
from mindft.protocol import Ack, ActionKind, CostReport, Register, StepReport
from mindft.observe.status_page import PAGE, make_app, status_document

T = Timeouts(heartbeat_interval=1.0, heartbeat_misses=3, register=10.0, pause=5.0, repair=20.0, rollback=5.0,
             resume=5.0)


def _job_in_repair() -> Job:
    job = Job(2, T, 0.0)
    for rank in (0, 1):
        job.handle(f"r{rank}".encode(), Register(rank, 0, 100 + rank, (0,)), 0.0)
    for step in (1, 2):
        for rank in (0, 1):
            job.handle(f"r{rank}".encode(), StepReport(rank, step), 0.0)
    job.device(DeviceFaulty(1), 1.0)
    for rank in (0, 1):
        job.handle(f"r{rank}".encode(), Ack(rank, ActionKind.PAUSE, 2, (1, 2), job.recovery.round), 1.0)
    return job


def test_the_document_shows_the_slowest_ranks_step_time() -> None:
    job = _job_in_repair()
    job.handle(b"r0", CostReport(0, 0.25, 0.01), 2.0)
    assert status_document(job.status(2.0), [])["job"]["step_seconds"] == 0.25


def test_the_document_shows_the_job_its_ranks_and_whom_the_recovery_waits_for() -> None:
    job = _job_in_repair()
    document = status_document(job.status(2.0), [["recovery 1: uce on rank 0; in place; recovered in 0.10s"]])
    assert document["job"]["state"] == "REPAIRING" and document["job"]["step"] == 2
    assert document["job"]["step_seconds"] == -1.0  # no rank reported its costs: the page shows none
    assert document["recovery"]["waiting_for"] == "rank 1 (its chip is being reset)"
    assert document["recovery"]["deadline_in_seconds"] == T.repair - 1.0
    assert [(r["rank"], r["pid"]) for r in document["ranks"]] == [(0, 100), (1, 101)]
    assert document["timelines"][0][0].startswith("recovery 1")
    json.dumps(document)  # what the page reads


def _get(app, path: str) -> tuple[str, dict[str, str], bytes]:
    answer: dict = {}

    def start_response(status: str, headers: list) -> None:
        answer["status"], answer["headers"] = status, dict(headers)
    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET", "QUERY_STRING": "", "wsgi.input": io.BytesIO()},
                        start_response))
    return answer["status"], answer["headers"], body


def test_the_app_serves_the_page_its_status_and_the_metrics() -> None:
    registry = CollectorRegistry()
    Counter("mindft_example", "An example.", registry=registry).inc()
    job = _job_in_repair()
    app = make_app(registry, lambda: job.status(2.0))
    status, headers, body = _get(app, "/")
    assert status == "200 OK" and headers["Content-Type"].startswith("text/html") and b"mindft job" in body
    status, _, body = _get(app, "/status.json")
    assert status == "200 OK" and json.loads(body)["job"]["state"] == "REPAIRING"
    status, _, body = _get(app, "/metrics")
    assert status.startswith("200") and b"mindft_example_total 1.0" in body
    assert _get(app, "/nothing")[0] == "404 Not Found"


def test_a_controller_that_does_not_answer_is_said_not_hidden() -> None:
    def silent():
        raise TimeoutError("no answer in 5 s")
    status, _, body = _get(make_app(CollectorRegistry(), silent), "/status.json")
    assert status.startswith("503") and "no answer in 5 s" in json.loads(body)["error"]


def test_the_page_fetches_nothing_from_elsewhere() -> None:
    # Clusters are often offline: no external script, style sheet, font or image.
    assert not re.search(r"https?://|<script[^>]+src=|<link[^>]+href=|@import|url\(", PAGE)


def test_the_page_says_which_term_commands_where_the_standbys_are_and_the_spares_waiting() -> None:
    from mindft.flow.job import Job
    from mindft.protocol import AgentHello

    job = Job(4, Timeouts(), 0.0, term=1, candidates=(2,), standing_by=True)  # 1 of 4 node agents: not yet
    job.handle(b"agent/2/1", AgentHello(2, (2,), address="tcp://10.0.0.3:29601"), 1.0)
    job.handle(b"agent/-1/9", AgentHello(-1, (), spare=True), 1.0)
    document = status_document(job.status(2.0), [])["job"]
    assert (document["term"], document["standing_by"], document["standbys"], document["spares"]) == \
        (1, True, ["tcp://10.0.0.3:29601"], 1)
