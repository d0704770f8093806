"""What every ``mindft`` subcommand shares: the exit codes, the error a command raises
(:class:`CommandError`: ``mindft: MESSAGE`` on stderr, or with ``--json`` one JSON object on
stdout), the command class that makes errors JSON under ``--json``, and how a command finds and
reaches the job's controller (:func:`resolve_target`, :func:`controller_options`).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import click

from mindft.agent.plan import JOB_FILE
from mindft.config import ConfigError, load_config
from mindft.exitcodes import ExitCode

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


def json_error(error: click.ClickException) -> CommandError:
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


class MindftCommand(click.Command):
    """A command whose errors, its command line's included, are JSON when it was given ``--json``."""

    def make_context(self, info_name: Optional[str], args: list[str], parent: Optional[click.Context] = None,
                     **extra: Any) -> click.Context:
        as_json = "--json" in args  # read before parsing, which consumes args
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as error:
            if as_json:
                raise json_error(error) from None
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as error:
            if ctx.params.get("as_json"):
                raise json_error(error) from None
            raise
        except BrokenPipeError:
            # The reader left (``mindft config check | head -2``): what it wanted was printed; not a failure.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_OK)


class MindftGroup(click.Group):
    """mindft's groups: their commands are :class:`MindftCommand`, their subgroups of this class."""

    command_class = MindftCommand
    group_class = type


def jsonable(value: object) -> object:
    """``value`` (a reply, the configuration) as JSON takes it: dataclasses as objects, enums as their values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def config_error(error: ConfigError) -> CommandError:
    """A configuration error (exit 2); its message begins with the variable at fault, which it names."""
    variable = re.match(r"[A-Z][A-Z0-9_]*", str(error))
    return CommandError(f"configuration error: {error}", EXIT_CONFIG_ERROR, variable.group(0) if variable else "")


@dataclass(frozen=True)
class Target:
    """Where the job's controller is and how to talk to it; from a job file, also the job's world
    size and the pid of the launcher that wrote it (0: not known)."""

    address: str
    key_file: Optional[Path]
    insecure: bool
    reset_file: Path
    world_size: int = 0
    launcher_pid: int = 0


def job_file(job: Path) -> Path:
    """``--job``: mindft-launch's run directory or its job.json, as job.json; a job that ended (its
    launcher removed job.json, its event log stays) is said so, pointing to ``mindft events``."""
    path = job / JOB_FILE if job.is_dir() else job
    if path.is_file():
        return path
    run_dir = path.parent
    if path.name == JOB_FILE and any(run_dir.glob("events*.jsonl")):
        raise CommandError(f"the job in {run_dir} has ended (its launcher removed {JOB_FILE}); its story: "
                           f"mindft events --job {run_dir}", EXIT_CONFIG_ERROR, "--job",
                           "RUN_DIR or RUN_DIR/job.json of a running mindft-launch")
    raise CommandError(f"--job {job}: no {JOB_FILE} there", EXIT_CONFIG_ERROR, "--job",
                       "RUN_DIR or RUN_DIR/job.json of a running mindft-launch")


def resolve_target(job: Optional[Path], address: Optional[str], key_file: Optional[Path], insecure: bool) -> Target:
    """Resolve the controller from --job (mindft-launch's job.json), explicit options or the environment."""
    try:
        config = load_config()
    except ConfigError as error:
        raise config_error(error) from None
    found = Target(config.controller_address, config.key_file, config.insecure, config.reset_file)
    if job is not None:
        job = job_file(job)
        try:
            info = json.loads(job.read_text())
            found = Target(info["controller"], Path(info["key_file"]) if info.get("key_file") else None,
                           bool(info.get("insecure")), Path(info.get("reset_file") or found.reset_file),
                           int(info.get("world_size") or 0), int(info.get("launcher_pid") or 0))
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


def controller_client(target: Target, timeout: float) -> Any:
    """A :class:`~mindft.net.channel.Client` of ``target``'s controller, with the job's key (exit 2 without one)."""
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


def controller_options(function: Any) -> Any:
    """The options that find the job's controller (``--job``, ``--address``, ``--key-file``,
    ``--insecure``, ``--timeout``), for :func:`resolve_target`."""
    options = [
        click.option("--job", type=click.Path(path_type=Path), envvar="MINDFT_JOB_FILE",
                     help="mindft-launch's run directory, or its job.json (address, key, reset file). "
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


def status_reply(target: Target, timeout: float) -> Any:
    """The controller's status (exit 5 when it does not answer)."""
    from mindft.net.channel import ControllerUnreachable

    try:
        return controller_client(target, timeout).status()
    except ControllerUnreachable as error:
        raise unreachable(error, target) from None


def unreachable(error: Exception, target: Target) -> CommandError:
    """The controller did not answer (exit 5), naming where it was looked for, and saying when the
    launcher that wrote the job file is gone."""
    message = str(error)
    if target.launcher_pid and not _running(target.launcher_pid):
        message += (f"; the launcher that wrote the job file (pid {target.launcher_pid}) is not running: the job "
                    f"ended without removing it (its launcher was killed?)")
    return CommandError(message, EXIT_UNREACHABLE, "--address",
                        f"a running job's controller, with its key (--job RUN_DIR/job.json; tried {target.address})")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
