"""``mindft status``: the job as its controller sees it: its state, the step every rank finished,
the recoveries and the snapshot cadence, and a table of ranks (with their replicas when streamed)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import click

from mindft.cli._common import MindftCommand, controller_options, jsonable, resolve_target, status_reply
from mindft.flow.goodput import PRODUCTIVE
from mindft.observe.timeline import goodput_text
from mindft.protocol import RankState


def _age(seconds: float) -> str:
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}min ago"


@click.command("status", cls=MindftCommand)
@controller_options
@click.option("--json", "as_json", is_flag=True, help="Print the controller's reply as JSON.")
def status(job: Optional[Path], address: Optional[str], key_file: Optional[Path], insecure: bool,
           timeout: float, as_json: bool) -> None:
    """Show the job: controller state, the step every rank finished, recoveries, and a table of ranks.

    Exit code 0 when the controller answered (whatever the job's state), 5 when it did not.
    """
    reply = status_reply(resolve_target(job, address, key_file, insecure), timeout)
    if as_json:
        click.echo(json.dumps(jsonable(reply), indent=2))
        return
    click.echo(f"job state: {reply.state}   every rank finished step: {reply.step}   "
               f"recoveries: {reply.recoveries}   snapshots: {_cadence_text(reply)}")
    if reply.reason:
        click.echo(f"reason: {reply.reason}")
    header = ("RANK", "STATE", "STEP", "LAST HEARTBEAT", "RESTARTS", "PID")
    rows = [(str(r.rank), r.state, str(r.step), _age(r.last_heartbeat_age), str(r.restarts), str(r.pid))
            for r in reply.ranks]
    if any(r.replicated >= 0 or r.replica_lost or r.state is RankState.LOST for r in reply.ranks):
        # Replicas are streamed (by the node agents or the ranks): the newest step held elsewhere, and lost protection.
        header += ("REPLICA",)
        rows = [row + (_replica_cell(r),) for row, r in zip(rows, reply.ranks)]
    if any(r.work_ratio > 0 for r in reply.ranks):
        # Slow ranks are measured: each rank's own work per step against its peers' median (mindft.flow.slow).
        header += ("OWN WORK",)
        rows = [row + (_work_cell(r),) for row, r in zip(rows, reply.ranks)]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if not rows:
        click.echo("(no rank has registered yet)")
    unprotected = [r.rank for r in reply.ranks if r.replica_lost]
    if unprotected:
        click.echo(f"LOST PROTECTION: {_rank_list(unprotected)}: the replica on the next node is gone or older "
                   f"than the steps every rank keeps; were {'its' if len(unprotected) == 1 else 'their'} node lost now, "
                   f"the job would end with dying-gasp checkpoints (the node agents' logs say why)")
    lost = [r.rank for r in reply.ranks if r.state is RankState.LOST]
    if lost:
        click.echo(f"NODE LOST: {_rank_list(lost)} can roll back only to the step of "
                   f"{'its replica' if len(lost) == 1 else 'their replicas'}, restored on the node that replaces it")
    slow = [r.rank for r in reply.ranks if r.slow]
    if slow:
        its, it = ("its", "it") if len(slow) == 1 else ("their", "them")
        click.echo(f"SLOW: {_rank_list(slow)}: {its} own work per step is over {its} peers' median by more than "
                   f"MINDFT_SLOW_THRESHOLD, window after window; every data-parallel step waits for {it}")
    if reply.wall_seconds > 0:
        click.echo("goodput: " + goodput_text({PRODUCTIVE: reply.productive_seconds,
                                                **dict(zip(reply.badput, reply.badput_seconds))}))
    if reply.max_nodes:
        click.echo(f"world: {reply.world_size} rank(s) on {reply.nodes} node(s), elastic {reply.min_nodes}:"
                   f"{reply.max_nodes} (--nnodes), {reply.resizes} resize(s) so far (mindft events: when and why)")
    if reply.term or reply.standbys or reply.spares:
        click.echo(f"controller: {_controller_text(reply)}")


def _cadence_text(reply: Any) -> str:
    """How often the ranks snapshot, what it costs, and against which budget."""
    every = "every step" if reply.snapshot_every == 1 else f"every {reply.snapshot_every} steps"
    if not reply.overhead_budget:
        return f"{every} (MINDFT_SNAPSHOT_EVERY)"
    budget = f"budget {100 * reply.overhead_budget:g}%"
    if reply.snapshot_cost < 0:
        return f"{every} (no cost measured yet, {budget})"
    over = " OVER BUDGET: MINDFT_MAX_REPLAY_STEPS bounds the cadence" if reply.over_budget else ""
    return f"{every} (~{100 * reply.snapshot_cost:.1f}% of a step, {budget}){over}"


def _controller_text(reply: Any) -> str:
    """The controller's term, whether it commands yet, its standbys and the spares waiting."""
    what = f"term {reply.term}" + (" (a standby, not in command yet)" if reply.standing_by else "")
    standbys = ", ".join(s or "(not heard yet)" for s in reply.standbys) or "none"
    return f"{what}; standbys: {standbys}; warm spares waiting: {reply.spares}"


def _replica_cell(row: Any) -> str:
    """A status row's REPLICA cell: the newest replicated step and whether protection is lost."""
    step = str(row.replicated) if row.replicated >= 0 else "none yet"
    return f"{step} LOST PROTECTION" if row.replica_lost else step


def _work_cell(row: Any) -> str:
    """A status row's OWN WORK cell: its work per step against its peers' median, SLOW when flagged."""
    ratio = f"{row.work_ratio:.2f}×" if row.work_ratio > 0 else "–"
    return f"{ratio} SLOW" if row.slow else ratio


def _rank_list(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, ranks[:limit])) + (f", ... ({len(ranks)} in all)" if len(ranks) > limit else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
