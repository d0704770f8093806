"""The ``mindft`` command: configuration check, job status, event log, fault injection, keys (for people).

Exit codes: :data:`CLI_CODES` of :mod:`mindft.exitcodes`, listed by ``mindft --help``. A
command's error is ``mindft: MESSAGE`` on stderr, or with ``--json`` a JSON object on stdout
(:class:`CommandError`).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import click

from mindft.config import TFT_VARIABLE, ConfigError, MindftConfig, TFTOptions, load_config
from mindft.exitcodes import ExitCode, help_block
from mindft.device.simulator import device_script
from mindft.preflight import BackendChoice, check_launchable, choose_backend
from mindft.protocol import RankState

EXIT_OK = ExitCode.OK
EXIT_FAILED = ExitCode.FAILED
EXIT_CONFIG_ERROR = ExitCode.USAGE
EXIT_UNREACHABLE = ExitCode.UNREACHABLE
CLI_CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.UNREACHABLE)  # what a mindft command returns


class CommandError(click.ClickException):
    """A command's error: ``mindft: MESSAGE`` on stderr, or under ``--json`` one JSON object on
    stdout, ``{"error": MESSAGE, "input": ..., "valid": ..., "exit_code": ...}`` (``input``: the
    option or variable at fault, ``valid``: what it accepts, each when known)."""

    def __init__(self, message: str, exit_code: int, input_name: str = "", valid: str = "") -> None:
        super().__init__(message)
        self.exit_code = int(exit_code)
        self.input_name = input_name
        self.valid = valid
        self.as_json = False

    def show(self, file: Any = None) -> None:
        if self.as_json:
            fields = {"error": self.message, "input": self.input_name, "valid": self.valid, "exit_code": self.exit_code}
            click.echo(json.dumps({key: value for key, value in fields.items() if value != ""}))
        else:
            click.echo(f"mindft: {self.message}", err=True)


def _json_error(error: click.ClickException) -> CommandError:
    """``error`` as a :class:`CommandError` printed as JSON (click's usage errors name their option)."""
    if isinstance(error, CommandError):
        error.as_json = True
        return error
    param = getattr(error, "param", None)
    name = getattr(error, "option_name", "") or (param.opts[0] if param is not None and param.opts else "")
    choices = getattr(getattr(param, "type", None), "choices", None)
    converted = CommandError(error.format_message(), error.exit_code, name,
                             ", ".join(map(str, choices)) if choices else "")
    converted.as_json = True
    return converted


class _Command(click.Command):
    """A command whose errors, its command line's included, are JSON when it was given ``--json``."""

    def make_context(self, info_name: Optional[str], args: list[str], parent: Optional[click.Context] = None,
                     **extra: Any) -> click.Context:
        as_json = "--json" in args  # read before parsing, which consumes args
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as error:
            if as_json:
                raise _json_error(error) from None
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as error:
            if ctx.params.get("as_json"):
                raise _json_error(error) from None
            raise


class _Group(click.Group):
    """mindft's groups: their commands are :class:`_Command`, their subgroups of this class."""

    command_class = _Command
    group_class = type


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]},
             help="mindft: graceful fault tolerance for MindSpore training.\n\n"
                  + help_block(CLI_CODES, "Exit codes (mindft-launch --help lists every code):"))
@click.version_option(package_name="mindft", message="mindft %(version)s")
def main() -> None:
    """The ``mindft`` command group."""


@main.group("config")
def config_group() -> None:
    """Inspect mindft's configuration."""


def _shown(value: object) -> str:
    """A configuration value as a user writes it: yes/no, numbers without a needless '.0', '-' when unset."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    text = str(value)
    return text[:-2] if isinstance(value, float) and text.endswith(".0") else text


def _config_rows(config: MindftConfig, tft_text: Optional[str],
                 choice: Optional[BackendChoice] = None) -> list[tuple[str, str]]:
    """``config check``'s table: MS_ENABLE_TFT as written (shell-quoted), then what it means and every value."""
    rows = [("MS_ENABLE_TFT", "-" if tft_text is None else shlex.quote(tft_text)),
            ("options in effect", "-" if config.tft == TFTOptions() else str(config.tft)),
            ("fault tolerance enabled", _shown(config.tft.enabled)),
            ("needs mindio-ttp (in MindSpore)", _shown(config.tft.needs_mindio))]
    if choice is not None:
        rows += [("backend", choice.backend), ("backend because", choice.reason)]
    for field in dataclasses.fields(config):
        if field.name in ("tft", "timeouts"):
            continue
        rows.append((field.name, _shown(getattr(config, field.name))))
    rows.append(("controller address", config.controller_address))
    for field in dataclasses.fields(config.timeouts):
        rows.append((f"timeouts.{field.name}", _shown(getattr(config.timeouts, field.name))))
    return rows


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


@config_group.command("check")
@click.option("--json", "as_json", is_flag=True, help="Print the resolved configuration as JSON.")
def config_check(as_json: bool) -> None:
    """Validate the environment as mindft-launch does and print the resolved configuration.

    Besides the variables' syntax it checks the key file (MINDFT_KEY_FILE) and, with
    MINDFT_BACKEND=mindio, that the mindio_ttp wheel imports; with fault tolerance on it says
    which backend the ranks will run and why. Exit code 2 on any error.
    """
    try:
        config = load_config()
        check_launchable(config)
    except ConfigError as error:
        raise _config_error(error) from None
    choice = _backend_choice(config) if config.tft.enabled else None
    if as_json:
        resolved = _jsonable(config)
        if choice is not None:
            resolved["backend_choice"] = _jsonable(choice)
        click.echo(json.dumps(resolved, indent=2))
        return
    rows = _config_rows(config, os.environ.get(TFT_VARIABLE), choice)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")


def _config_error(error: ConfigError) -> CommandError:
    """A configuration error (exit 2); its message begins with the variable at fault, which it names."""
    variable = re.match(r"[A-Z][A-Z0-9_]*", str(error))
    return CommandError(f"configuration error: {error}", EXIT_CONFIG_ERROR, variable.group(0) if variable else "")


def _backend_choice(config: MindftConfig) -> BackendChoice:
    """Which backend the ranks will run, decided as they will (MindSpore imported only if it matters)."""
    import importlib.util

    def device() -> str:
        import mindspore

        return str(mindspore.get_context("device_target"))

    return choose_backend(config, importlib.util.find_spec("mindio_ttp") is not None, device)


@main.command("keygen")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def keygen(path: Path, force: bool) -> None:
    """Write a new CurveZMQ job key pair to PATH (mode 600), e.g. for a job on several nodes."""
    from mindft.net.keys import generate_keys

    if path.exists() and not force:
        raise CommandError(f"{path} exists; use --force to replace it (every node of a running job "
                           f"would lose access)", EXIT_FAILED, "PATH")
    keys = generate_keys(path)
    click.echo(f"wrote a job key pair to {path} (mode 600); public key {keys.public.decode()}")
    click.echo(f"use it with: mindft-launch --key-file {path} ...  or  export MINDFT_KEY_FILE={path}")


@dataclass(frozen=True)
class _Target:
    """Where the job's controller is and how to talk to it."""

    address: str
    key_file: Optional[Path]
    insecure: bool
    reset_file: Path


def _target(job: Optional[Path], address: Optional[str], key_file: Optional[Path], insecure: bool) -> _Target:
    """Resolve the controller from --job (mindft-launch's job.json), explicit options or the environment."""
    try:
        config = load_config()
    except ConfigError as error:
        raise _config_error(error) from None
    found = _Target(config.controller_address, config.key_file, config.insecure, config.reset_file)
    if job is not None:
        try:
            info = json.loads(job.read_text())
            found = _Target(info["controller"], Path(info["key_file"]) if info.get("key_file") else None,
                            bool(info.get("insecure")), Path(info.get("reset_file") or found.reset_file))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CommandError(f"--job {job}: not a job file written by mindft-launch ({error})", EXIT_CONFIG_ERROR,
                               "--job", "RUN_DIR/job.json of a running mindft-launch") from None
    if address:
        try:
            found = dataclasses.replace(found, address=controller_endpoint(address))
        except ValueError as error:
            raise CommandError(f"--address: {error}", EXIT_CONFIG_ERROR, "--address",
                               "HOST:PORT or tcp://HOST:PORT") from None
    if key_file:
        found = dataclasses.replace(found, key_file=key_file, insecure=False)
    if insecure:
        found = dataclasses.replace(found, key_file=None, insecure=True)
    return found


def controller_endpoint(address: str) -> str:
    """The ZeroMQ endpoint for ``address``: ``tcp://HOST:PORT``, or ``HOST:PORT`` / ``[IPv6]:PORT``.

    Raises ValueError, naming the input and the accepted forms, for anything else.
    """
    text = address.strip()
    body = text[len("tcp://"):] if text.startswith("tcp://") else text
    host, colon, port = body.rpartition(":")
    usage = f"{address!r} is not a controller address; use HOST:PORT or tcp://HOST:PORT, e.g. 127.0.0.1:29600"
    if "://" in body or not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(usage)
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{usage} (write an IPv6 address in brackets: [::1]:29600)")
    return f"tcp://{host}:{int(port)}"


def _client(target: _Target, timeout: float) -> Any:
    from mindft.net.keys import load_keys
    from mindft.net.channel import Client

    if target.insecure:
        keys = None
    elif target.key_file is None:
        raise CommandError("no job key: pass --job RUN_DIR/job.json, --key-file PATH or --insecure "
                           "(or set MINDFT_KEY_FILE)", EXIT_CONFIG_ERROR, "--key-file",
                           "--job RUN_DIR/job.json, --key-file PATH, --insecure or MINDFT_KEY_FILE")
    else:
        try:
            keys = load_keys(target.key_file)
        except ConfigError as error:
            raise CommandError(str(error), EXIT_CONFIG_ERROR, "--key-file") from None
    return Client(target.address, keys, timeout=timeout)


def _controller_options(function: Any) -> Any:
    options = [
        click.option("--job", type=click.Path(dir_okay=False, exists=True, path_type=Path),
                     envvar="MINDFT_JOB_FILE",
                     help="job.json in mindft-launch's run directory (address, key, reset file). "
                          "[env: MINDFT_JOB_FILE]"),
        click.option("--address", help="Controller address, HOST:PORT or tcp://HOST:PORT "
                                       "(e.g. 127.0.0.1:29600). Default: MS_TFT_IP/MS_TFT_PORT."),
        click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path),
                     help="Job key file. Default: MINDFT_KEY_FILE."),
        click.option("--insecure", is_flag=True, help="Talk to a controller started with --insecure."),
        click.option("--timeout", type=click.FloatRange(0.1), default=5.0, show_default=True,
                     help="Seconds to wait for the controller."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _status_reply(target: _Target, timeout: float) -> Any:
    from mindft.net.channel import ControllerUnreachable

    try:
        return _client(target, timeout).status()
    except ControllerUnreachable as error:
        raise _unreachable(error, target) from None


def _unreachable(error: Exception, target: _Target) -> CommandError:
    return CommandError(str(error), EXIT_UNREACHABLE, "--address",
                        f"a running job's controller, with its key (--job RUN_DIR/job.json; tried {target.address})")


def _age(seconds: float) -> str:
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}min ago"


@main.command("status")
@_controller_options
@click.option("--json", "as_json", is_flag=True, help="Print the controller's reply as JSON.")
def status(job: Optional[Path], address: Optional[str], key_file: Optional[Path], insecure: bool,
           timeout: float, as_json: bool) -> None:
    """Show the job: controller state, the step every rank finished, recoveries, and a table of ranks.

    Exit code 0 when the controller answered (whatever the job's state), 5 when it did not.
    """
    reply = _status_reply(_target(job, address, key_file, insecure), timeout)
    if as_json:
        click.echo(json.dumps(_jsonable(reply), indent=2))
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


def _replica_cell(row: Any) -> str:
    """A status row's REPLICA cell: the newest replicated step and whether protection is lost."""
    step = str(row.replicated) if row.replicated >= 0 else "none yet"
    return f"{step} LOST PROTECTION" if row.replica_lost else step


def _rank_list(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, ranks[:limit])) + (f", ... ({len(ranks)} in all)" if len(ranks) > limit else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


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


def _reset_file_to_write(path: Path, job: Optional[Path], job_reset_file: Path) -> Path:
    """``path``, unless its directory does not exist and no job (--job) watches it: then no job can
    see what would be written there (the default is the device plugin's mount), so refuse (exit 2)
    rather than create directories nobody asked for."""
    if path.parent.exists() or (job is not None and path == job_reset_file):
        return path
    raise CommandError(f"the reset file's directory {path.parent} does not exist, so no job watches {path}; "
                       f"pass --job RUN_DIR/job.json of the running job, or --reset-file in an existing directory",
                       EXIT_CONFIG_ERROR, "--reset-file", "a path in an existing directory, or --job RUN_DIR/job.json")


@main.command("inject")
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
@_controller_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inject(rank: int, fault: str, reset_file: Optional[Path], recover_after: float, no_recover: bool,
           error_code: str, policy: str, job: Optional[Path], address: Optional[str],
           key_file: Optional[Path], insecure: bool, timeout: float, as_json: bool) -> None:
    """Inject a fault into a running job (for demos and drills)."""
    target = _target(job, address, key_file, insecure)
    if fault == "hot-reset":
        path = _reset_file_to_write(reset_file or target.reset_file, job, target.reset_file)
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
            reply = _client(target, timeout).request(
                InjectRequest(rank=rank, fault=FaultKind.UCE, detail="injected by 'mindft inject'"))
        except ControllerUnreachable as error:
            raise _unreachable(error, target) from None
        ok = isinstance(reply, Reply) and reply.ok
        detail = getattr(reply, "detail", type(reply).__name__)
        click.echo(json.dumps({"ok": ok, "rank": rank, "fault": fault, "detail": detail,
                               **({} if ok else {"error": f"refused: {detail}"})}) if as_json
                   else f"{'ok' if ok else 'refused'}: {detail}")
        sys.exit(EXIT_OK if ok else EXIT_FAILED)
    reply = _status_reply(target, timeout)
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


FOLLOW_INTERVAL = 0.5   # between reads of the event files under --follow
FOLLOW_PROGRESS = 5.0   # a progress line under --follow when a recovery sits this long without news
FOLLOW_IDLE_END = 10.0  # --follow ends this long after job.json is gone (the launcher ended) with no news


@main.command("events")
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
    from mindft.observe.timeline import recoveries, render

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
    finished = [e for e in found if isinstance(e.record, events.JobFinished)]
    if finished:
        click.echo(f"job finished: exit code {finished[-1].record.exit_code}: {finished[-1].record.reason}")


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


@main.command("simulate-device-plugin")
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
    job_reset_file = _target(job, None, None, False).reset_file
    path = _reset_file_to_write(reset_file or job_reset_file, job, job_reset_file)
    try:
        device_script(path, sorted(set(ranks)), delay, hold, None if outcome == "none" else outcome,
                      _error_code(error_code), policy, functools.partial(_emit, as_json), _job_pids(job),
                      process_deadline)
    except OSError as error:
        raise CommandError(f"cannot write the reset file {path}: {error}", EXIT_FAILED, "--reset-file") from None


if __name__ == "__main__":
    main()
