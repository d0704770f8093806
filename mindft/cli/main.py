"""The ``mindft`` command: configuration check, job status, event log, fault injection, keys (for people).

Exit codes: :data:`CLI_CODES` of :mod:`mindft.exitcodes`, listed by ``mindft --help``. A
command's error is ``mindft: MESSAGE`` on stderr, or with ``--json`` a JSON object on stdout
(:class:`~mindft.cli._common.CommandError`).

This module is the group, ``config check`` and ``keygen``; the other subcommands are
:mod:`mindft.cli.status`, :mod:`mindft.cli.events` and :mod:`mindft.cli.inject` (``inject``,
``simulate-device-plugin``), on the ground of :mod:`mindft.cli._common`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path
from typing import Optional

import click

from mindft.cli._common import (CLI_CODES, EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, CommandError,
                                MindftGroup, config_error, controller_endpoint, jsonable)
from mindft.cli.events import events_command
from mindft.cli.inject import inject, simulate_device_plugin
from mindft.cli.status import status
from mindft.config import FIELD_VARIABLES, TFT_VARIABLE, ConfigError, MindftConfig, TFTOptions, load_config
from mindft.exitcodes import help_block
from mindft.preflight import BackendChoice, check_launchable, choose_backend

# What tests and scripts import from here, beside the group.
__all__ = ["CLI_CODES", "EXIT_CONFIG_ERROR", "EXIT_FAILED", "EXIT_OK", "EXIT_UNREACHABLE", "CommandError",
           "controller_endpoint", "main"]


@click.group(cls=MindftGroup, context_settings={"help_option_names": ["-h", "--help"]},
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
        rows += [("backend chosen", choice.backend), ("backend chosen because", choice.reason)]
    for field in dataclasses.fields(config):
        if field.name in ("tft", "timeouts"):
            continue
        rows.append((FIELD_VARIABLES[field.name], _shown(getattr(config, field.name))))
    rows.append(("controller address", config.controller_address))
    for field in dataclasses.fields(config.timeouts):
        rows.append((FIELD_VARIABLES[field.name], _shown(getattr(config.timeouts, field.name))))
    return rows


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
        raise config_error(error) from None
    choice = _backend_choice(config) if config.tft.enabled else None
    if as_json:
        resolved = jsonable(config)
        if choice is not None:
            resolved["backend_choice"] = jsonable(choice)
        click.echo(json.dumps(resolved, indent=2))
        return
    rows = _config_rows(config, os.environ.get(TFT_VARIABLE), choice)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")


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
    if not path.parent.is_dir():
        raise CommandError(f"{path.parent} is not a directory: create it first (a key's directory is yours to "
                           f"choose and to protect)", EXIT_CONFIG_ERROR, "PATH", "a file in an existing directory")
    keys = generate_keys(path)
    click.echo(f"wrote a job key pair to {path} (mode 600); public key {keys.public.decode()}")
    click.echo(f"use it with: mindft-launch --key-file {path} ...  or  export MINDFT_KEY_FILE={path}")


for _command in (status, inject, events_command, simulate_device_plugin):
    main.add_command(_command)


if __name__ == "__main__":
    main()
