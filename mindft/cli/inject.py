"""Faults on purpose, for demos and drills: ``mindft inject`` (a hot reset, an uncorrectable
memory error, a killed or hung rank) and ``mindft simulate-device-plugin`` (the Ascend device
plugin's part of a hot reset, written to the reset file as the plugin writes it)."""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import click

from mindft.cli._common import (EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_OK, CommandError, MindftCommand, Target,
                                controller_client, controller_options, resolve_target, status_reply, unreachable)
from mindft.device.simulator import device_script

FAULTS = ("hot-reset", "uce", "kill", "hang")


def _emit(as_json: bool, event: str, **fields: Any) -> None:
    if as_json:
        click.echo(json.dumps({"event": event, "time": round(time.time(), 3), **fields}))
    else:
        details = ", ".join(f"{key} {value}" for key, value in fields.items() if key != "rank")
        rank = fields.get("rank")
        click.echo(f"device plugin: rank {rank} {event}" + (f" ({details})" if details else ""))


def _job_pids(job: Optional[Path]) -> Optional[dict[int, int]]:
    """Rank → pid from mindft-launch's job.json (the processes on each rank's chip), if given."""
    if job is None:
        return None
    try:
        return {int(rank): int(pid) for rank, pid in json.loads(job.read_text()).get("ranks", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _error_code(value: str) -> int:
    try:
        return int(value, 0)
    except ValueError:
        raise CommandError(f"--error-code: {value!r} is not a number (e.g. 0x80E01801)", EXIT_CONFIG_ERROR,
                           "--error-code", "a number, e.g. 0x80E01801") from None


def _reset_file_to_write(path: Path, watched: bool) -> Path:
    """``path``, where a device plugin would write: in a directory that exists (the plugin's mount,
    or the one ``MINDFT_RESET_FILE`` names). A missing directory is never created (exit 2):
    ``watched``, the job watches a reset file nothing mounted (a job on CPU: start it with
    ``MINDFT_RESET_FILE`` in an existing directory to inject hot resets)."""
    if path.parent.exists():
        return path
    if watched:
        raise CommandError(f"the job watches the reset file {path}, but nothing mounted its directory {path.parent} "
                           f"(on Ascend the device plugin does): start the job with MINDFT_RESET_FILE in an existing "
                           f"directory (e.g. RUN_DIR/reset.json) to inject hot resets", EXIT_CONFIG_ERROR,
                           "--reset-file", "the reset file of a job that has one mounted")
    raise CommandError(f"the reset file's directory {path.parent} does not exist, so no job watches {path}; "
                       f"pass --job RUN_DIR of the running job, or --reset-file in an existing directory",
                       EXIT_CONFIG_ERROR, "--reset-file", "a path in an existing directory, or --job RUN_DIR")


def _check_rank(rank: int, target: Target, timeout: float, ask: bool) -> None:
    """Refuse (exit 2) a rank the job does not have: from the job file's world size, else from the
    ranks the controller named by ``--address`` (``ask``) knows, when it answers."""
    from mindft.net.channel import ControllerUnreachable

    if target.world_size:
        known = range(target.world_size)
    elif not ask:
        return
    else:
        try:
            known = [row.rank for row in controller_client(target, timeout).status().ranks]
        except (ControllerUnreachable, CommandError):
            return  # nobody to ask: the reset file says what it says
    if rank not in known:
        valid = f"0..{len(known) - 1}" if known else "none registered yet"
        raise CommandError(f"--rank {rank}: the job has no rank {rank} (its ranks: {valid})", EXIT_CONFIG_ERROR,
                           "--rank", f"a rank of the job: {valid}")


@click.command("inject", cls=MindftCommand)
@click.option("--rank", type=click.IntRange(0), required=True, help="The rank to hit.")
@click.option("--fault", type=click.Choice(FAULTS), required=True,
              help="hot-reset: write the reset file as the device plugin does (faulty, then recovered); "
                   "uce: the rank raises an uncorrectable memory error at its next step (via the "
                   "controller, whose answer says what the job will do); kill: SIGKILL the rank's process; "
                   "hang: SIGSTOP it (same node only).")
@click.option("--reset-file", type=click.Path(dir_okay=False, path_type=Path),
              help="hot-reset: the reset file. Default: from --job, else MINDFT_RESET_FILE.")
@click.option("--recover-after", type=click.FloatRange(0), default=3.0, show_default=True,
              help="hot-reset: seconds between 'unrecovered' and 'recovered'.")
@click.option("--no-recover", is_flag=True, help="hot-reset: leave the device unrecovered.")
@click.option("--error-code", default="0x80E01801", show_default=True, help="hot-reset: the fault code.")
@click.option("--policy", default="restart_request", show_default=True, help="hot-reset: the reset policy.")
@controller_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inject(rank: int, fault: str, reset_file: Optional[Path], recover_after: float, no_recover: bool,
           error_code: str, policy: str, job: Optional[Path], address: Optional[str],
           key_file: Optional[Path], insecure: bool, timeout: float, as_json: bool) -> None:
    """Inject a fault into a running job (for demos and drills)."""
    target = resolve_target(job, address, key_file, insecure)
    if fault == "hot-reset":
        _check_rank(rank, target, timeout, ask=address is not None)
        path = _reset_file_to_write(reset_file or target.reset_file,
                                    watched=reset_file is None and job is not None)
        try:
            device_script(path, [rank], 0.0, recover_after, None if no_recover else "recovered",
                          _error_code(error_code), policy, functools.partial(_emit, as_json))
        except OSError as error:
            raise CommandError(f"cannot write the reset file {path}: {error}", EXIT_FAILED, "--reset-file") from None
        return
    from mindft.net.channel import ControllerUnreachable
    from mindft.protocol import FaultKind, InjectRequest, Reply

    if fault == "uce":
        try:
            reply = controller_client(target, timeout).request(
                InjectRequest(rank=rank, fault=FaultKind.UCE, detail="injected by 'mindft inject'"))
        except ControllerUnreachable as error:
            raise unreachable(error, target) from None
        ok = isinstance(reply, Reply) and reply.ok
        detail = getattr(reply, "detail", type(reply).__name__)
        click.echo(json.dumps({"ok": ok, "rank": rank, "fault": fault, "detail": detail,
                               **({} if ok else {"error": f"refused: {detail}"})}) if as_json
                   else f"{'ok' if ok else 'refused'}: {detail}")
        sys.exit(EXIT_OK if ok else EXIT_FAILED)
    reply = status_reply(target, timeout)
    row = next((r for r in reply.ranks if r.rank == rank), None)
    if row is None or row.pid <= 0:
        known = ", ".join(str(r.rank) for r in reply.ranks if r.pid > 0) or "none yet"
        raise CommandError(f"the controller knows no process for rank {rank}", EXIT_FAILED, "--rank",
                           f"a rank with a process: {known}")
    signum = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
    try:
        os.kill(row.pid, signum)
    except ProcessLookupError:
        raise CommandError(f"rank {rank}'s process {row.pid} does not exist here "
                           f"(kill and hang work on the rank's own node)", EXIT_FAILED, "--rank",
                           "a rank on this node") from None
    except PermissionError as error:
        raise CommandError(f"cannot signal pid {row.pid}: {error}", EXIT_FAILED, "--rank") from None
    name = signal.Signals(signum).name
    click.echo(json.dumps({"ok": True, "rank": rank, "fault": fault, "pid": row.pid, "signal": name})
               if as_json else f"sent {name} to rank {rank} (pid {row.pid})")


@click.command("simulate-device-plugin", cls=MindftCommand)
@click.option("--rank", "ranks", type=click.IntRange(0), multiple=True, required=True,
              help="A rank whose chip fails (repeat for several).")
@click.option("--reset-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Default: from --job, else MINDFT_RESET_FILE (/user/restore/reset/config/reset.json).")
@click.option("--job", type=click.Path(dir_okay=False, exists=True, path_type=Path), envvar="MINDFT_JOB_FILE",
              help="Take the reset file from mindft-launch's job.json. [env: MINDFT_JOB_FILE]")
@click.option("--delay", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Seconds before the fault.")
@click.option("--hold", type=click.FloatRange(0), default=3.0, show_default=True,
              help="Seconds the chip stays 'unrecovered' (the hot reset).")
@click.option("--outcome", type=click.Choice(["recovered", "failed", "none"]), default="recovered",
              show_default=True, help="How the hot reset ends ('none': leave it unrecovered).")
@click.option("--error-code", default="0x80E01801", show_default=True, help="The fault code written.")
@click.option("--policy", default="restart_request", show_default=True,
              help="The reset policy written (restart_request, restart, reset, isolate, ...).")
@click.option("--process-deadline", type=click.FloatRange(0), default=60.0, show_default=True,
              help="With --job: seconds the chip's processes get to exit before the chip is failed "
                   "('failed', policy isolate), as the plugin waits before a reset.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line per state written.")
def simulate_device_plugin(ranks: Sequence[int], reset_file: Optional[Path], job: Optional[Path], delay: float,
                           hold: float, outcome: str, error_code: str, policy: str, process_deadline: float,
                           as_json: bool) -> None:
    """Play the Ascend device plugin's part of a hot reset: write 'unrecovered', wait, write the outcome.

    With --job the reset waits, as the plugin's does, until the processes on the chip (the
    ranks' pids in job.json) have exited, and fails the chip if they stay past --process-deadline.

    The file is written as the plugin writes the reset-config-<job name> ConfigMap:
    compact Go JSON listing only these ranks, RetryTime + 1 per fault, restartType
    beside it; truncated then rewritten in place (the hostPath mirror), or published
    with kubelet's atomic ..data swap and a checkCode when the file is a configMap
    volume's symlink. A job's ResetWatcher reacts exactly as on a real device fault.
    """
    target = resolve_target(job, None, None, False)
    for rank in set(ranks):
        _check_rank(rank, target, 0.0, ask=False)
    path = _reset_file_to_write(reset_file or target.reset_file, watched=reset_file is None and job is not None)
    try:
        device_script(path, sorted(set(ranks)), delay, hold, None if outcome == "none" else outcome,
                      _error_code(error_code), policy, functools.partial(_emit, as_json), _job_pids(job),
                      process_deadline)
    except OSError as error:
        raise CommandError(f"cannot write the reset file {path}: {error}", EXIT_FAILED, "--reset-file") from None
