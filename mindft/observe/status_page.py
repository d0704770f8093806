"""The live status page, served with the metrics (``mindft-launch --metrics-port``): the job, a
table of its ranks, the recovery in progress (whom its phase waits for, its deadline) and the
timeline of past recoveries.

A shell, like the metrics: it shows what the controller already knows, its status
(:meth:`Controller.latest_status`) and its event log (:mod:`mindft.observe.events`, grouped by
:mod:`mindft.observe.timeline`), and decides nothing. The page is one HTML document with its own style
and script and nothing fetched from elsewhere (clusters are often offline): the script reads
``status.json`` every second and redraws; the page only reads.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, make_wsgi_app

from mindft.observe import events as event_log
from mindft.protocol import StatusReply
from mindft.observe.timeline import recoveries, render

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0
PAST_RECOVERIES = 20  # the page shows the newest this many


def status_document(status: StatusReply, past: Iterable[list[str]]) -> dict[str, Any]:
    """What the page shows, as JSON: the job, its ranks, and the timelines of its recoveries (as
    :func:`mindft.observe.timeline.render` writes them)."""
    waiting = status.state.value in ("PAUSING", "REPAIRING", "ROLLBACK", "RESUMING")
    return {
        "job": {"state": status.state.value, "step": status.step, "recoveries": status.recoveries,
                "round": status.round, "restart_all": status.restart_all, "reason": status.reason,
                "snapshot_every": status.snapshot_every, "snapshot_cost_seconds": status.snapshot_cost,
                "step_seconds": status.step_time,
                "overhead_budget": status.overhead_budget, "over_budget": status.over_budget,
                "term": status.term, "standing_by": status.standing_by, "standbys": list(status.standbys),
                "spares": status.spares, "wall_seconds": status.wall_seconds,
                "world": {"ranks": status.world_size, "nodes": status.nodes, "min_nodes": status.min_nodes,
                          "max_nodes": status.max_nodes, "resizes": status.resizes},
                "productive_seconds": status.productive_seconds,
                "badput_seconds": dict(zip(status.badput, status.badput_seconds))},
        "recovery": ({"state": status.state.value, "waiting_for": status.waiting,
                      "deadline_in_seconds": status.deadline_in} if waiting else None),
        "ranks": [{"rank": r.rank, "state": r.state.value, "step": r.step, "pid": r.pid, "restarts": r.restarts,
                   "incarnation": r.incarnation, "heartbeat_age_seconds": r.last_heartbeat_age,
                   "replicated_step": r.replicated, "lost_protection": r.replica_lost, "work_ratio": r.work_ratio,
                   "slow": r.slow}
                  for r in status.ranks],
        "timelines": [list(lines) for lines in past],
    }


def past_timelines(run_dir: Optional[Path]) -> list[list[str]]:
    """The newest :data:`PAST_RECOVERIES` recoveries of the job's event log, newest first."""
    if run_dir is None:
        return []
    try:
        found = recoveries(event_log.read(run_dir))
    except OSError as error:
        log.warning("status page: cannot read the event log in %s: %s", run_dir, error)
        return []
    numbered = list(enumerate(found, 1))[-PAST_RECOVERIES:]
    return [render(recovery, number) for number, recovery in reversed(numbered)]


def make_app(registry: CollectorRegistry, status: Callable[[], StatusReply],
             run_dir: Optional[Path] = None) -> Callable[..., Iterable[bytes]]:
    """The WSGI application: ``/`` the page, ``/status.json`` what it shows, ``/metrics``
    Prometheus' exposition of ``registry``."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path in ("/", "/index.html"):
            return _answer(start_response, "200 OK", "text/html; charset=utf-8", PAGE.encode())
        if path == "/status.json":
            try:
                document = status_document(status(), past_timelines(run_dir))
            except Exception as error:  # noqa: BLE001 - the controller did not answer: say so, keep serving
                return _answer(start_response, "503 Service Unavailable", "application/json",
                               json.dumps({"error": f"no status from the controller: {error}"}).encode())
            return _answer(start_response, "200 OK", "application/json", json.dumps(document).encode())
        if path == "/metrics":
            return metrics(environ, start_response)
        return _answer(start_response, "404 Not Found", "text/plain; charset=utf-8",
                       b"not found: / (the status page), /status.json, /metrics\n")
    return app


def _answer(start_response: Callable[..., Any], code: str, kind: str, body: bytes) -> list[bytes]:
    start_response(code, [("Content-Type", kind), ("Content-Length", str(len(body))), ("Cache-Control", "no-store")])
    return [body]


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mindft job</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d232a; background: #fafafa; }
h1 { font-size: 1.3em; margin: 0 0 .6em; } h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
.state { display: inline-block; padding: .1em .6em; border-radius: .3em; background: #dfe8f1; font-weight: 600; }
.state.NORMAL, .state.DONE { background: #d7f0dc; } .state.FAILED { background: #f6d5d5; }
.state.PAUSING, .state.REPAIRING, .state.ROLLBACK, .state.RESUMING { background: #fbeccb; }
table { border-collapse: collapse; } td, th { padding: .2em .8em; border-bottom: 1px solid #e1e4e8; text-align: right; }
th { background: #eef1f4; } td.text, th.text { text-align: left; }
pre { background: #fff; border: 1px solid #e1e4e8; padding: .6em; overflow-x: auto; }
#error { color: #a40000; } .muted { color: #66707a; }
</style></head>
<body>
<h1>mindft job <span id="state" class="state">…</span></h1>
<div id="job" class="muted">waiting for the controller…</div>
<div id="goodput" class="muted"></div>
<div id="world" class="muted"></div>
<div id="controller" class="muted"></div>
<div id="error"></div>
<h2>Recovery in progress</h2><div id="recovery" class="muted">none</div>
<h2>Ranks</h2>
<table><thead><tr><th>rank</th><th class="text">state</th><th>step</th><th>pid</th><th>restarts</th>
<th>heartbeat age (s)</th><th>replicated step</th><th class="text">protection</th>
<th class="text">own work per step</th></tr></thead>
<tbody id="ranks"></tbody></table>
<h2>Recoveries, newest first</h2><div id="timelines" class="muted">none yet</div>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
function text(id, value) { document.getElementById(id).textContent = value; }
function cell(row, value, cls) { const td = row.insertCell(); td.textContent = value; if (cls) td.className = cls; }
function draw(doc) {
  const job = doc.job, state = document.getElementById("state");
  state.textContent = job.state; state.className = "state " + job.state;
  text("job", `step ${job.step}` + (job.step_seconds >= 0 ? ` (${job.step_seconds.toFixed(3)} s per step)` : "") +
       ` · ${job.recoveries} recover${job.recoveries === 1 ? "y" : "ies"} · ` +
       `snapshot every ${job.snapshot_every} step(s)` + (job.over_budget ? " (over budget)" : "") +
       (job.reason ? ` · ${job.reason}` : ""));
  text("goodput", job.wall_seconds > 0 ? `goodput ${(100 * job.productive_seconds / job.wall_seconds).toFixed(1)}% ` +
       `of ${job.wall_seconds.toFixed(1)} s; the rest: ` + (Object.entries(job.badput_seconds)
       .filter(([, s]) => s >= 0.05).map(([name, s]) => `${name} ${s.toFixed(1)} s`).join(", ") || "none") : "");
  text("world", `${job.world.ranks} rank(s) on ${job.world.nodes} node(s)` + (job.world.max_nodes ?
       ` · elastic ${job.world.min_nodes}:${job.world.max_nodes}, ${job.world.resizes} resize(s)` : ""));
  text("controller", `term ${job.term}` + (job.standing_by ? " (a standby, not in command yet)" : "") +
       ` · standbys: ${job.standbys.map(s => s || "(not heard yet)").join(", ") || "none"}` +
       ` · warm spares waiting: ${job.spares}`);
  const recovery = document.getElementById("recovery");
  recovery.textContent = doc.recovery ? `round ${job.round}, ${doc.recovery.state}: waiting for ` +
      `${doc.recovery.waiting_for || "nobody"}; ${Math.round(doc.recovery.deadline_in_seconds)} s to its deadline`
    : "none";
  const body = document.getElementById("ranks"); body.replaceChildren();
  for (const r of doc.ranks) {
    const row = body.insertRow(); row.id = "rank-" + r.rank;
    cell(row, r.rank); cell(row, r.state, "text"); cell(row, r.step); cell(row, r.pid); cell(row, r.restarts);
    cell(row, r.heartbeat_age_seconds.toFixed(1)); cell(row, r.replicated_step < 0 ? "–" : r.replicated_step);
    cell(row, r.lost_protection ? "LOST PROTECTION" : "ok", "text");
    cell(row, (r.work_ratio > 0 ? `${r.work_ratio.toFixed(2)}× peers'` : "–") + (r.slow ? " SLOW" : ""), "text");
  }
  const past = document.getElementById("timelines"); past.replaceChildren();
  if (!doc.timelines.length) past.textContent = "none yet";
  for (const lines of doc.timelines) { const pre = document.createElement("pre"); pre.textContent = lines.join("\\n"); past.append(pre); }
}
async function refresh() {
  try {
    const answer = await fetch("status.json", {cache: "no-store"});
    const doc = await answer.json();
    if (!answer.ok) throw new Error(doc.error || answer.statusText);
    draw(doc); text("error", "");
  } catch (error) { text("error", "no answer from the job: " + error.message); }
  setTimeout(refresh, REFRESH_MS);
}
refresh();
</script>
</body></html>
""".replace("__REFRESH_MS__", str(int(REFRESH_SECONDS * 1000)))
