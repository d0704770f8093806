"""The documentation's tables that drift, checked against the code (pure and fast).

README.md and docs/*.md state facts the code decides: the exit codes, the environment
variables, the timeout ladder, the protocol version, the wire messages, the job's states,
the CLI's commands, and links between pages. Each test parses the Markdown tables simply
(a header row, a separator row, rows of cells) and names the row that drifted.
"""
from __future__ import annotations

import configparser
import dataclasses
import importlib.metadata
import re
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import mindft.config
import mindft.protocol
from mindft.config import ENV_VARS, Timeouts
from mindft.exitcodes import ExitCode, describe, explain
from mindft.flow.states import JobState

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
DESIGN = DOCS / "design.md"


def pages() -> list[Path]:
    """Every Markdown page of the documentation: the README and docs/*.md."""
    return [README, *sorted(DOCS.glob("*.md"))]


class Row(NamedTuple):
    """One row of a Markdown table: where it is and its cells (backticks and escapes removed)."""

    path: Path
    line: int
    cells: tuple[str, ...]

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: | {' | '.join(self.cells)} |"


class Table(NamedTuple):
    """A Markdown table: its header (lower case) and its rows."""

    header: tuple[str, ...]
    rows: list[Row]


def _without_code_blocks(text: str) -> list[str]:
    """The page's lines, those inside fenced code blocks blanked (line numbers kept)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def _cells(line: str) -> tuple[str, ...]:
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return tuple(cell.strip().replace("\\|", "|").replace("`", "").strip()
                 for cell in re.split(r"(?<!\\)\|", body))


def tables(path: Path) -> Iterator[Table]:
    """Every table of a page (a '|' line followed by a '|---|' separator starts one)."""
    lines = _without_code_blocks(path.read_text(encoding="utf-8"))
    index = 0
    while index < len(lines) - 1:
        line, separator = lines[index].strip(), lines[index + 1].strip()
        if line.startswith("|") and re.fullmatch(r"\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?", separator):
            header = tuple(cell.lower() for cell in _cells(line))
            rows = []
            index += 2
            while index < len(lines) and lines[index].strip().startswith("|"):
                rows.append(Row(path, index + 1, _cells(lines[index])))
                index += 1
            yield Table(header, rows)
        else:
            index += 1


def tables_with(header_start: tuple[str, ...], paths: Optional[list[Path]] = None) -> list[Table]:
    """The tables whose header begins with ``header_start``."""
    return [table for path in (paths or pages()) for table in tables(path)
            if table.header[:len(header_start)] == header_start]


def one_table(path: Path, header_start: tuple[str, ...]) -> Table:
    found = tables_with(header_start, [path])
    assert len(found) == 1, (f"{path.relative_to(ROOT)}: expected one table whose header begins "
                             f"{' | '.join(header_start)}, found {len(found)}")
    return found[0]


def _number(text: str) -> Optional[float]:
    match = re.match(r"\s*(-?\d+(?:\.\d+)?)", text)
    return float(match.group(1)) if match else None


def test_exit_code_tables_match_exitcodes() -> None:
    found = tables_with(("code", "name", "meaning"))
    assert any(row.path == README for table in found for row in table.rows), \
        "README.md has no exit-code table (header: code | name | meaning)"
    for table in found:
        listed = set()
        for row in table.rows:
            code, name, meaning = row.cells[:3]
            assert code.isdigit(), f"{row.where()}: the code is not a number"
            assert int(code) in {member.value for member in ExitCode}, \
                f"{row.where()}: mindft.exitcodes.ExitCode has no code {code}"
            member = ExitCode(int(code))
            assert name == member.name, f"{row.where()}: code {code} is ExitCode.{member.name}, not {name}"
            assert meaning.startswith(describe(member)), \
                f"{row.where()}: the meaning should begin with describe({code}) = {describe(member)!r}"
            assert meaning == explain(member), \
                f"{row.where()}: the meaning should be explain({code}) = {explain(member)!r}, as --help says it"
            listed.add(member)
        missing = sorted(set(ExitCode) - listed)
        where = table.rows[0].path.relative_to(ROOT) if table.rows else "?"
        assert not missing, f"{where}: the exit-code table misses {', '.join(f'{m.value} ({m.name})' for m in missing)}"


def help_exit_codes(text: str) -> dict[int, str]:
    """The exit codes a --help text lists under its 'Exit codes' heading: code → meaning, its
    wrapped lines joined (the list ends at the first line that is neither an entry nor its continuation)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("Exit codes")), None)
    assert start is not None, f"no 'Exit codes' heading in:\n{text}"
    found: dict[int, str] = {}
    last = None
    for line in lines[start + 1:]:
        entry = re.fullmatch(r"\s+(\d+)\s+(\S.*)", line)
        if entry:
            last = int(entry.group(1))
            assert last not in found, f"code {last} is listed twice"
            found[last] = entry.group(2).strip()
        elif last is not None and line.startswith(" " * 8) and line.strip():
            found[last] += " " + line.strip()
        else:
            break
    return found


def test_help_lists_the_exit_codes_in_the_words_of_exitcodes() -> None:
    from click.testing import CliRunner

    from mindft.cli.main import CLI_CODES, main as cli
    from mindft.cli.launch import main as launch

    launcher = CliRunner().invoke(launch, ["--help"])
    assert launcher.exit_code == 0, launcher.output
    assert help_exit_codes(launcher.output) == {code.value: explain(code) for code in ExitCode}, \
        "mindft-launch --help should list every ExitCode in the words of mindft.exitcodes.explain"
    commands = CliRunner().invoke(cli, ["--help"])
    assert commands.exit_code == 0, commands.output
    assert help_exit_codes(commands.output) == {code.value: explain(code) for code in CLI_CODES}, \
        "mindft --help should list the codes a mindft command returns in the words of mindft.exitcodes.explain"


def test_exitcodes_words_every_code_once() -> None:
    for code in ExitCode:
        assert explain(code).startswith(describe(code)) and explain(code) != describe(code), code
    assert "128 + the signal: 130 SIGINT, 143 SIGTERM" in explain(ExitCode.INTERRUPTED)


def _same_value(documented: str, actual: str) -> bool:
    documented, actual = documented.strip(), actual.strip()
    if documented in ("unset", "") and actual in ("unset", ""):
        return True
    if re.fullmatch(r"-?\d+(\.\d+)?", documented) and re.fullmatch(r"-?\d+(\.\d+)?", actual):
        return float(documented) == float(actual)
    return documented == actual


def test_environment_table_lists_exactly_what_load_config_reads() -> None:
    table = one_table(CONFIGURATION, ("variable", "meaning", "default", "valid"))
    code = {var.name: var for var in ENV_VARS}
    seen: dict[str, Row] = {}
    for row in table.rows:
        name, _meaning, default, valid = row.cells[:4]
        assert name in code, f"{row.where()}: {name} is documented but mindft.config.ENV_VARS does not read it"
        assert name not in seen, f"{row.where()}: {name} is documented twice (also line {seen[name].line})"
        seen[name] = row
        assert _same_value(default, code[name].default), \
            f"{row.where()}: the default of {name} is {code[name].default!r} in mindft.config, not {default!r}"
        assert _same_value(valid, code[name].valid), \
            f"{row.where()}: the valid values of {name} are {code[name].valid!r} in mindft.config, not {valid!r}"
    missing = [name for name in code if name not in seen]
    assert not missing, f"docs/configuration.md: the environment table misses {', '.join(missing)}"


def _source_literals() -> set[str]:
    """Every quoted string literal that looks like an environment variable in mindft's source."""
    names = set()
    for path in (ROOT / "mindft").rglob("*.py"):
        names.update(re.findall(r"[\"']([A-Z][A-Z0-9]*_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    return names


def test_other_variables_are_read_by_mindft() -> None:
    table = one_table(CONFIGURATION, ("variable", "read by", "meaning"))
    literals = _source_literals()
    in_env_vars = {var.name for var in ENV_VARS}
    for row in table.rows:
        name = row.cells[0]
        assert name not in in_env_vars, f"{row.where()}: {name} belongs in the environment table (ENV_VARS)"
        assert name in literals, f"{row.where()}: no module of mindft/ names {name!r}: it is not read"


def test_every_mindft_variable_in_the_source_is_documented() -> None:
    documented = {row.cells[0] for table in (tables_with(("variable",), [CONFIGURATION])) for row in table.rows}
    undocumented = sorted(name for name in _source_literals()
                          if name.startswith("MINDFT_") and name not in documented)
    assert not undocumented, f"docs/configuration.md documents none of {', '.join(undocumented)}"


def test_timeout_ladder_matches_timeouts() -> None:
    table = one_table(CONFIGURATION, ("timeout", "variable", "default"))
    defaults = Timeouts()
    variables = {t.attribute: t.variable for t in mindft.config._TIMEOUT_VARS}
    fields = {field.name for field in dataclasses.fields(Timeouts)}
    seen = set()
    for row in table.rows:
        name, variable, default = row.cells[:3]
        value = _number(default)
        if name == "dead_after":
            assert value == defaults.dead_after, \
                f"{row.where()}: dead_after is {defaults.dead_after:g} s by default, not {default!r}"
            continue
        assert name in fields, f"{row.where()}: mindft.config.Timeouts has no field {name!r}"
        assert variable == variables.get(name), \
            f"{row.where()}: Timeouts.{name} is set by {variables.get(name)}, not {variable!r}"
        assert value == float(getattr(defaults, name)), \
            f"{row.where()}: Timeouts.{name} defaults to {getattr(defaults, name):g}, not {default!r}"
        seen.add(name)
    missing = sorted(fields - seen)
    assert not missing, f"docs/configuration.md: the timeout ladder misses {', '.join(missing)}"


def test_protocol_version_where_the_docs_state_it() -> None:
    pattern = re.compile(r"protocol version (\d+)|PROTOCOL_VERSION = (\d+)|\{\"v\": (\d+)", re.IGNORECASE)
    stated_in_design = False
    for path in pages():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in pattern.finditer(line):
                version = int(next(group for group in match.groups() if group))
                assert version == mindft.protocol.PROTOCOL_VERSION, (
                    f"{path.relative_to(ROOT)}:{number}: states protocol version {version}; "
                    f"mindft.protocol.PROTOCOL_VERSION is {mindft.protocol.PROTOCOL_VERSION}")
                stated_in_design |= path == DESIGN
    assert stated_in_design, "docs/design.md does not state the protocol version"


def _messages() -> dict[str, tuple[str, ...]]:
    return {name: tuple(field.name for field in dataclasses.fields(cls))
            for name, cls in vars(mindft.protocol).items()
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) and "KIND" in vars(cls)}


def test_message_table_matches_the_protocol() -> None:
    table = one_table(DESIGN, ("message", "direction", "fields"))
    messages = _messages()
    seen = set()
    for row in table.rows:
        name, _direction, fields = row.cells[:3]
        assert name in messages, f"{row.where()}: mindft.protocol has no message {name}"
        documented = tuple(field.strip() for field in fields.split(","))
        assert documented == messages[name], \
            f"{row.where()}: {name}'s fields are {', '.join(messages[name])} in mindft.protocol"
        seen.add(name)
    missing = sorted(set(messages) - seen)
    assert not missing, f"docs/design.md: the message table misses {', '.join(missing)}"


def test_state_table_matches_job_states() -> None:
    table = one_table(DESIGN, ("state", "entered when"))
    documented = [row.cells[0] for row in table.rows]
    for row in table.rows:
        assert row.cells[0] in JobState.__members__, f"{row.where()}: flow.states.JobState has no {row.cells[0]}"
    missing = [state.name for state in JobState if state.name not in documented]
    assert not missing, f"docs/design.md: the state table misses {', '.join(missing)}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().replace("`", "").lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    for line in _without_code_blocks(path.read_text(encoding="utf-8")):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug, suffix = _slug(match.group(1)), 1
            while (slug if suffix == 1 else f"{slug}-{suffix - 1}") in anchors:
                suffix += 1
            anchors.add(slug if suffix == 1 else f"{slug}-{suffix - 1}")
    return anchors


def test_relative_links_point_to_existing_files_and_headings() -> None:
    broken = []
    for path in pages():
        for number, line in enumerate(_without_code_blocks(path.read_text(encoding="utf-8")), start=1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                resolved = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(ROOT)}:{number}: ({target})"
                if not resolved.exists():
                    broken.append(f"{where}: no such file")
                    continue
                if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                    broken.append(f"{where}: no heading with the anchor #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _commands(group: object, prefix: str = "") -> Iterator[str]:
    import click

    assert isinstance(group, click.Group)
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}"


def test_readme_cli_table_matches_the_cli() -> None:
    from mindft.cli.main import main

    commands = set(_commands(main))
    table = one_table(README, ("command", "what it does"))
    documented = set()
    for row in table.rows:
        words = row.cells[0].split()
        assert words[:1] == ["mindft"], f"{row.where()}: not a mindft command"
        name = next((c for c in sorted(commands, key=len, reverse=True)
                     if words[1:1 + len(c.split())] == c.split()), None)
        assert name is not None, f"{row.where()}: mindft has no such command ({', '.join(sorted(commands))})"
        documented.add(name)
    missing = sorted(commands - documented)
    assert not missing, f"README.md: the command table misses mindft {', '.join(missing)}"


def test_readme_quick_start_is_what_ci_runs() -> None:
    text = README.read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = "pip install -e '.[test]' && pytest"
    assert any(line.strip() == test_command for line in ci.splitlines()), ".ci/run no longer runs the README's test command"
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", text, re.DOTALL)
    assert block, "README.md: no bash block under '## Quick start'"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["pip install -e . && python examples/demo.py", test_command], \
        f"README.md's quick start should be exactly the demo and the test command, found {commands}"
    assert (ROOT / "examples" / "demo.py").exists()


def test_readme_lists_every_page_of_the_docs() -> None:
    text = README.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| \[docs/([a-z_]+\.md)\]\(docs/\1\) \|", text, re.MULTILINE))
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert listed == pages, f"README.md's table of the docs misses {sorted(pages - listed)}, names gone {sorted(listed - pages)}"


def test_every_run_in_the_testing_pages_log_names_when_it_ran() -> None:
    # The suite's current counts and times are the README's (checked); a row of this log that names no
    # issue or commit would read as a current figure once the suite has grown (issue 47: "862 of 984").
    text = (DOCS / "testing.md").read_text(encoding="utf-8")
    log = re.search(r"^\| run \| tests \| wall time \|.*\n\|[-|]+\|\n((?:\|.*\n)+)", text, re.MULTILINE)
    assert log, "docs/testing.md: no log of runs (header: run | tests | wall time | ...)"
    rows = [line.split(" | ")[0].lstrip("| ") for line in log.group(1).splitlines()]
    undated = [row for row in rows if not re.search(r"\bissues? \d+|\bcommit [0-9a-f]{7,40}\b", row)]
    assert len(rows) >= 5 and not undated, f"docs/testing.md's log: rows naming no issue or commit: {undated}"


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; keep it to ~250 and move the rest into docs/"


def test_every_release_ci_tests_is_in_the_range_and_in_the_compatibility_table() -> None:
    from packaging.requirements import Requirement

    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    suite = re.search(r"^SUITE_RELEASE=(\S+)$", script, re.MULTILINE)
    compat = re.search(r"^COMPAT_RELEASES=\(([^)]*)\)$", script, re.MULTILINE)
    assert suite and compat, ".ci/run names no SUITE_RELEASE or COMPAT_RELEASES"
    releases = [suite[1], *compat[1].split()]
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    mindspore = next(Requirement(line) for line in parser["options"]["install_requires"].splitlines()
                     if line.strip().startswith("mindspore"))
    assert [r for r in releases if not mindspore.specifier.contains(r)] == [], f"setup.cfg's {mindspore}"
    assert len({r.rsplit(".", 1)[0] for r in releases}) == 4, f"one release per minor 2.7-2.10: {releases}"
    table = (ROOT / "docs" / "compatibility.md").read_text(encoding="utf-8")
    rows = {m[1] for m in re.finditer(r"^\| \*{0,2}(\d+\.\d+\.\d+)\*{0,2} \|", table, re.MULTILINE)}
    assert set(releases) <= rows, f"docs/compatibility.md's table lacks {sorted(set(releases) - rows)}"


def test_mindspore_range_contains_the_tested_version_and_is_documented() -> None:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    requirements = [Requirement(line) for line in parser["options"]["install_requires"].splitlines()
                    if line.strip() and not line.strip().startswith("#")]
    mindspore = next(r for r in requirements if r.name == "mindspore")
    assert not any(spec.operator == "==" for spec in mindspore.specifier), \
        f"setup.cfg pins {mindspore}; give the range mindft is tested with"
    installed = importlib.metadata.version("mindspore")
    assert mindspore.specifier.contains(installed), f"setup.cfg's {mindspore} excludes the MindSpore tested here ({installed})"
    stated = [SpecifierSet(match) for match in re.findall(r"`mindspore([<>=~!][^`]*)`", README.read_text(encoding="utf-8"))]
    assert mindspore.specifier in stated, \
        f"README.md's prerequisites do not state the range `mindspore{mindspore.specifier}` (found {stated})"
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").count("Apache License") >= 1
