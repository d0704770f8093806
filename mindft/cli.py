"""The ``mindft`` command: configuration check, status and fault injection (for people)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from mindft.config import ConfigError, MindftConfig, load_config

EXIT_CONFIG_ERROR = 2


@click.group()
@click.version_option(package_name="mindft")
def main() -> None:
    """mindft: graceful fault tolerance for MindSpore training."""


@main.group("config")
def config_group() -> None:
    """Inspect mindft's configuration."""


def _config_rows(config: MindftConfig) -> list[tuple[str, str]]:
    rows = [("MS_ENABLE_TFT", str(config.tft)),
            ("fault tolerance enabled", "yes" if config.tft.enabled else "no"),
            ("needs mindio-ttp (in MindSpore)", "yes" if config.tft.needs_mindio else "no")]
    for field in dataclasses.fields(config):
        if field.name in ("tft", "timeouts"):
            continue
        rows.append((field.name, str(getattr(config, field.name))))
    rows.append(("controller address", config.controller_address))
    for field in dataclasses.fields(config.timeouts):
        rows.append((f"timeouts.{field.name}", str(getattr(config.timeouts, field.name))))
    return rows


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    return value


@config_group.command("check")
@click.option("--json", "as_json", is_flag=True, help="Print the resolved configuration as JSON.")
def config_check(as_json: bool) -> None:
    """Validate the environment and print the resolved configuration."""
    try:
        config = load_config()
    except ConfigError as error:
        click.echo(f"mindft: configuration error: {error}", err=True)
        sys.exit(EXIT_CONFIG_ERROR)
    if as_json:
        click.echo(json.dumps(_jsonable(config), indent=2))
        return
    rows = _config_rows(config)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")
