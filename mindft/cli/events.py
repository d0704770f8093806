"""``mindft events``: the job's event log, as the timeline of every recovery, or followed live."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from mindft.cli._common import EXIT_CONFIG_ERROR, CommandError, MindftCommand

FOLLOW_INTERVAL = 0.5   # between reads of the event files under --follow
FOLLOW_PROGRESS = 5.0   # a progress line under --follow when a recovery sits this long without news
FOLLOW_IDLE_END = 10.0  # --follow ends this long after job.json is gone (the launcher ended) with no news


@click.command("events", cls=MindftCommand)
@click.option("--job", type=click.Path(path_type=Path), required=True, envvar="MINDFT_JOB_FILE",
              help="RUN_DIR/job.json of mindft-launch (also once the job ended and job.json is gone), or "
                   "the run directory RUN_DIR. [env: MINDFT_JOB_FILE]")
@click.option("--follow", is_flag=True, help="Keep printing new events until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw events, one JSON object a line.")
def events_command(job: Path, follow: bool, as_json: bool) -> None:
    """Show the job's event log: the timeline of every recovery (seconds after the fault: the fault,
    the ladder's decision, pause, kills and exits, process starts, restore, resume, total).

    The log is RUN_DIR/events.jsonl (the controller's, on node 0) and RUN_DIR/events-node<N>.jsonl
    (each node agent's); they stay in the run directory after the job. Exit code 0, or 2 when the
    run directory holds no event log (without --follow).
    """
    from mindft.observe import events
    from mindft.observe.timeline import describe, goodput_text, recoveries, render

    run_dir = job if job.is_dir() else job.parent
    if not run_dir.is_dir():
        raise CommandError(f"{job}: no such run directory", EXIT_CONFIG_ERROR, "--job",
                           "RUN_DIR/job.json or RUN_DIR of a mindft-launch job")
    if follow:
        _follow_events(run_dir, as_json)
        return
    found = events.read(run_dir)
    if not found:
        raise CommandError(f"no event log in {run_dir} (events*.jsonl): not a mindft-launch run directory, or "
                           f"its job wrote no event yet", EXIT_CONFIG_ERROR, "--job",
                           "RUN_DIR/job.json or RUN_DIR of a mindft-launch job")
    if as_json:
        for event in found:
            click.echo(json.dumps(events.as_json(event)))
        return
    found_recoveries = recoveries(found)
    for number, recovery in enumerate(found_recoveries, 1):
        click.echo("\n".join(render(recovery, number)))
    if not found_recoveries:
        click.echo(f"no recovery ({len(found)} events, {events.iso_time(found[0].at)} to "
                   f"{events.iso_time(found[-1].at)})")
    for event in found:
        if isinstance(event.record, events.RankSlow):
            click.echo(f"{events.iso_time(event.at)} {event.record.reason}")
        elif isinstance(event.record, events.WorldResized):
            click.echo(f"{events.iso_time(event.at)} {describe(event)}")
    finished = [e for e in found if isinstance(e.record, events.JobFinished)]
    if finished:
        click.echo(f"job finished: exit code {finished[-1].record.exit_code}: {finished[-1].record.reason}")
        seconds = finished[-1].record.seconds
        if seconds:
            click.echo(f"goodput: {goodput_text(seconds)}")


def _follow_events(run_dir: Path, as_json: bool) -> None:
    """``mindft events --follow``: each new event as it is written; a recovery's timeline when it
    ends; a progress line while one waits; until the controller's verdict (or the launcher is gone)."""
    from mindft.observe import events
    from mindft.observe.timeline import describe, recoveries, render

    tail = events.EventTail(run_dir)
    seen: list[Any] = []
    found: list[Any] = []  # recoveries(seen), grouped again only when events came
    last_news = last_line = time.monotonic()
    while True:
        new = tail.poll()
        now = time.monotonic()
        for event in new:
            seen.append(event)
            if as_json:
                click.echo(json.dumps(events.as_json(event)))
                continue
            click.echo(f"{events.iso_time(event.at)[11:23]}  {describe(event)}")
            record = event.record
            if isinstance(record, events.JobMoved) and record.to_state in ("NORMAL", "FAILED") and \
                    record.from_state in ("PAUSING", "REPAIRING", "ROLLBACK", "RESUMING"):
                done = recoveries(seen)
                click.echo("\n".join(render(done[-1], len(done))))
        if new:
            last_news = last_line = now
            found = recoveries(seen)
        if any(isinstance(e.record, events.JobFinished) for e in new):
            return
        if not (run_dir / "job.json").exists() and now - last_news > FOLLOW_IDLE_END:
            if not as_json:
                click.echo("the job's launcher is gone (no job.json); stopping")
            return
        if not as_json and found and found[-1].end is None and now - last_line >= FOLLOW_PROGRESS:
            last_line = now
            state = next((e.record.to_state for e in reversed(seen) if isinstance(e.record, events.JobMoved)), "?")
            click.echo(f"... recovery {len(found)}: {state}, {time.time() - found[-1].start:.0f}s "
                       f"after the fault, no news for {now - last_news:.0f}s")
        time.sleep(FOLLOW_INTERVAL)
