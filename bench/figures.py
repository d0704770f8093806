"""The figures of docs/performance.md that a benchmark's JSON holds, checked against that JSON.

A figure is marked by an HTML comment right after its number (a rendered page does not show it):

    | (a) mindft | **87.4 %**<!-- figure goodput results.a.goodput scale=100 --> | 243 s | ...

``figure BENCHMARK KEY`` names the JSON the benchmark writes (bench/results/BENCHMARK.json, whose
"benchmark" field says BENCHMARK) and where the value is in it: keys joined by dots; on a list,
``*`` takes every item, a number one item, ``FIELD=VALUE`` the item whose FIELD is VALUE. Several
numbers (rounds) stand for their median, as the page's tables give medians. Options: ``over=KEY``
(the figure is the ratio of the two), ``scale=`` (100 for a percentage), ``tolerance=`` (a share of
the measured value; TOLERANCE unless given). A key with spaces is quoted.

    python bench/figures.py --check bench/results   # each figure against the JSON of a full run
    python bench/figures.py --write bench/results   # the page's figures rewritten from that JSON
    python bench/figures.py --keys RESULT.json      # every key the page names for its benchmark is there

``--check`` exits 1 when a figure is off by more than its tolerance or its key is gone; a benchmark
without its JSON there is reported as not checked. ``--keys`` checks that the keys exist, and the
values only of figures marked ``tolerance=0`` (no run changes them): a benchmark's short form
(``--quick``) measures other values, and the suite runs ``--keys`` on the JSON of each short form
(tests/integration/bench/). A ``FIELD=VALUE`` item the short form does not run stands there for
every item of its list: its field is checked, its value only by ``--check``.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

PAGE = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
# How far a full rerun on the idle 2-core VM moves a headline figure, by the page's own ranges (the
# recovery table's (b): 5.34–6.05 s about its median of 5.43 s, within 12 %); a noisier figure
# states its own.
TOLERANCE = 0.15
_MARK = re.compile(r"(?<!`)<!-- figure (.*?) -->")  # one in backquotes is an example, not a mark
# The number the mark follows: only a unit and emphasis may stand between them (`**87.4 %**`).
_NUMBER = re.compile(r"(?<![\d.,])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([ *_%A-Za-zµ×/]{0,8})$")
_OPTIONS = ("over", "scale", "tolerance")


class MarkError(ValueError):
    """A mark the page cannot be checked by: it follows no number, or its options are wrong."""


@dataclass(frozen=True)
class Figure:
    """One marked number of the page and where its value is measured."""

    line: int  # 1-based
    span: tuple[int, int]  # the number's characters in its line
    text: str  # the number as the page writes it
    benchmark: str
    key: str
    over: Optional[str] = None
    scale: float = 1.0
    tolerance: float = TOLERANCE

    @property
    def stated(self) -> float:
        return float(self.text.replace(",", ""))

    @property
    def decimals(self) -> int:
        return len(self.text.partition(".")[2])

    def __str__(self) -> str:
        ratio = f" / {self.over}" if self.over else ""
        scale = f" ×{self.scale:g}" if self.scale != 1.0 else ""
        return f"{self.benchmark} {self.key}{ratio}{scale}"


@dataclass(frozen=True)
class Verdict:
    """A figure against what a benchmark's JSON measured."""

    figure: Figure
    status: Literal["ok", "drifted", "gone", "unchecked"]  # gone: the key is not in the JSON; unchecked: no JSON
    measured: Optional[float] = None

    @property
    def failed(self) -> bool:
        return self.status in ("drifted", "gone")


def figures(text: str, name: str = "page") -> list[Figure]:
    """Every marked figure of ``text`` (MarkError naming ``name``:line for a mark that is wrong)."""
    found = []
    for index, line in enumerate(text.splitlines(), start=1):
        for mark in _MARK.finditer(line):
            where = f"{name}:{index}"
            number = _NUMBER.search(line, 0, mark.start())
            if not number:
                raise MarkError(f"{where}: the mark <!-- figure {mark[1]} --> follows no number "
                                f"(only a unit and ** may stand between them)")
            try:
                words = shlex.split(mark[1])
            except ValueError as error:
                raise MarkError(f"{where}: {error} in <!-- figure {mark[1]} -->") from None
            if len(words) < 2:
                raise MarkError(f"{where}: a mark is <!-- figure BENCHMARK KEY [option=value ...] -->")
            benchmark, key, *options = words
            found.append(Figure(index, (number.start(), number.end(2) if number[2] else number.end(1)),
                                number[1] + (number[2] or ""), benchmark, key, **_options(options, where)))
    return found


def _options(options: list[str], where: str) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for option in options:
        name, equals, value = option.partition("=")
        if not equals or name not in _OPTIONS:
            raise MarkError(f"{where}: unknown option {option!r}; known: {', '.join(f'{o}=' for o in _OPTIONS)}")
        try:
            parsed[name] = value if name == "over" else float(value)
        except ValueError:
            raise MarkError(f"{where}: {name}={value!r} is not a number") from None
    return parsed


def resolve(data: Any, key: str, shape: bool = False) -> list[float]:
    """The numbers at ``key`` in ``data`` (KeyError saying where the path ends). With ``shape``, a
    ``FIELD=VALUE`` that no item matches stands for every item that has FIELD."""
    nodes = [data]
    for segment in key.split("."):
        nodes = [child for node in nodes for child in _children(node, segment, shape)]
        if not nodes:
            raise KeyError(f"{key}: nothing at {segment!r}")
    values = [item for node in nodes for item in (node if isinstance(node, list) else [node])]
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise KeyError(f"{key}: not a number or a list of numbers")
    return [float(v) for v in values]


def _children(node: Any, segment: str, shape: bool) -> list[Any]:
    if isinstance(node, dict):
        return [node[segment]] if segment in node else []
    if not isinstance(node, list):
        return []
    if segment == "*":
        return list(node)
    if segment.isdigit():
        return [node[int(segment)]] if int(segment) < len(node) else []
    field, equals, value = segment.partition("=")
    if not equals:
        return []
    items = [item for item in node if isinstance(item, dict) and field in item]
    chosen = [item for item in items if str(item[field]) == value]
    return chosen or (items if shape else [])


def measure(figure: Figure, data: Any) -> float:
    """The figure's value as ``data`` (the benchmark's JSON) holds it (KeyError when it does not)."""
    value = statistics.median(resolve(data, figure.key))
    if figure.over:
        value /= statistics.median(resolve(data, figure.over))
    return value * figure.scale


def within(figure: Figure, measured: float) -> bool:
    """The page's number agrees with ``measured``: off by at most the tolerance, plus half the last
    digit the page writes (a figure given as 1.11 stands for 1.105 to 1.115)."""
    allowance = figure.tolerance * abs(measured) + 0.5 * 10.0 ** -figure.decimals
    return abs(figure.stated - measured) <= allowance


def check(marked: list[Figure], results: dict[str, Any]) -> list[Verdict]:
    """Each figure against its benchmark's JSON in ``results`` (benchmark → JSON)."""
    verdicts = []
    for figure in marked:
        if figure.benchmark not in results:
            verdicts.append(Verdict(figure, "unchecked"))
            continue
        try:
            measured = measure(figure, results[figure.benchmark])
        except (KeyError, ZeroDivisionError):
            verdicts.append(Verdict(figure, "gone"))
            continue
        verdicts.append(Verdict(figure, "ok" if within(figure, measured) else "drifted", measured))
    return verdicts


def short_form_problems(marked: list[Figure], data: Any) -> list[str]:
    """What the JSON of ``data``'s benchmark, from any form of it, contradicts in the page: a key of
    a figure marked for that benchmark that it does not hold, or a figure marked ``tolerance=0``
    (one no run changes, such as a message's size) that it measured otherwise."""
    problems = []
    for figure in marked:
        if figure.benchmark != data.get("benchmark"):
            continue
        for key in filter(None, (figure.key, figure.over)):
            try:
                resolve(data, key, shape=True)
            except KeyError as error:
                problems.append(f"line {figure.line}: {error.args[0]}")
        if figure.tolerance == 0:
            try:
                measured = measure(figure, data)
            except (KeyError, ZeroDivisionError):
                continue  # an item the short form does not run: its key was checked above
            if not within(figure, measured):
                problems.append(f"line {figure.line}: {figure} is {figure.text} on the page, {measured:g} here")
    return problems


def rewrite(text: str, verdicts: list[Verdict]) -> str:
    """``text`` with each measured figure written as measured, to the page's number of decimals."""
    lines = text.splitlines(keepends=True)
    # Right to left within a line: a number written longer or shorter moves what follows it.
    for verdict in sorted(verdicts, key=lambda v: (v.figure.line, v.figure.span[0]), reverse=True):
        figure = verdict.figure
        if verdict.measured is None:
            continue
        number = f"{verdict.measured:{',' if ',' in figure.text else ''}.{figure.decimals}f}"
        line = lines[figure.line - 1]
        lines[figure.line - 1] = line[:figure.span[0]] + number + line[figure.span[1]:]
    return "".join(lines)


def load_results(directory: Path, benchmarks: set[str]) -> dict[str, Any]:
    """The JSON of each of ``benchmarks`` that ``directory`` holds (BENCHMARK.json)."""
    return {name: json.loads((directory / f"{name}.json").read_text()) for name in sorted(benchmarks)
            if (directory / f"{name}.json").exists()}


def report(verdict: Verdict, name: str) -> str:
    figure = verdict.figure
    where = f"{name}:{figure.line} {figure}"
    if verdict.status == "unchecked":
        return f"{where}: not checked (no {figure.benchmark}.json: python bench/{figure.benchmark}.py)"
    if verdict.status == "gone":
        return f"{where}: GONE, the benchmark's JSON holds no such value"
    off = abs(figure.stated - verdict.measured) / abs(verdict.measured) if verdict.measured else float("inf")
    label = "ok" if verdict.status == "ok" else "DRIFTED"
    return (f"{where}: the page {figure.text}, measured {verdict.measured:.{figure.decimals + 1}f} "
            f"({100 * off:.1f} % off, tolerance {100 * figure.tolerance:g} %): {label}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", type=Path, metavar="DIR", help="compare each figure with DIR/BENCHMARK.json")
    mode.add_argument("--write", type=Path, metavar="DIR", help="rewrite the page's figures from DIR/BENCHMARK.json")
    mode.add_argument("--keys", type=Path, metavar="JSON", help="only that the keys the page names for the "
                                                                "benchmark that wrote JSON are in it")
    parser.add_argument("--page", type=Path, default=PAGE, help="the Markdown page (default: docs/performance.md)")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    try:
        marked = figures(text, args.page.name)
    except MarkError as error:
        print(error, file=sys.stderr)
        return 2
    if args.keys:
        data = json.loads(args.keys.read_text())
        mine = [f for f in marked if f.benchmark == data.get("benchmark")]
        problems = short_form_problems(marked, data)
        for problem in problems:
            print(f"{args.page.name} {problem}")
        print(f"{len(mine)} figures of {data.get('benchmark')!r} marked in {args.page.name}: "
              f"{len(problems)} contradicted by {args.keys}")
        return 1 if problems or not mine else 0
    directory = args.check or args.write
    verdicts = check(marked, load_results(directory, {f.benchmark for f in marked}))
    for verdict in verdicts:
        print(report(verdict, args.page.name))
    if args.write:
        args.page.write_text(rewrite(text, verdicts), encoding="utf-8")
        written = sum(v.measured is not None for v in verdicts)
        print(f"wrote {written} figures into {args.page}: the ranges, dates and prose around them are yours to update")
        return 1 if any(v.status == "gone" for v in verdicts) else 0
    failed = [v for v in verdicts if v.failed]
    print(f"{len(verdicts)} figures: {len(failed)} drifted or gone, "
          f"{sum(v.status == 'unchecked' for v in verdicts)} not checked")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
