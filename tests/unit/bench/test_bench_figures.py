"""bench/figures.py: the marks of docs/performance.md read, resolved in a benchmark's JSON, compared
within their tolerance and rewritten; and the page's own marks well formed (the keys against each
benchmark's short form: tests/integration/bench/)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from harness import ROOT

sys.path.insert(0, str(ROOT / "bench"))
try:
    import figures as fig  # bench/ is not a package
finally:
    sys.path.remove(str(ROOT / "bench"))

PAGE = (
    "# A page\n\n| way | goodput | wall |\n|---|---|---|\n"
    "| (a) | **87.4 %**<!-- figure goodput results.a.goodput scale=100 --> (0.80–0.90) | "
    "243 s<!-- figure goodput results.a.wall_s --> |\n"
    "Ratio **1.11**<!-- figure goodput results.a.goodput over=results.b.goodput tolerance=0 -->, "
    "over 1,632 steps<!-- figure goodput config.steps -->.\n"
    'init() took **4.11 s**<!-- figure recovery "rows.b.*.phases_s.init() (cluster)" --> and node 1 came back in\n'
    '9.3 s<!-- figure node_loss "losses.case=(a) node 1 back.resumed_s" tolerance=0.25 -->; '
    "a hello is 194 bytes<!-- figure node_loss hello.plain tolerance=0 -->.\n")
GOODPUT = {"benchmark": "goodput", "config": {"steps": 1632},
           "results": {"a": {"goodput": 0.8742, "wall_s": 243.3}, "b": {"goodput": 0.7878}}}
RECOVERY = {"benchmark": "recovery",
            "rows": {"b": [{"phases_s": {"init() (cluster)": t}} for t in (4.02, 4.11, 4.64)]}}
NODE_LOSS = {"benchmark": "node_loss", "hello": {"plain": 194},
             "losses": [{"case": "(a) node 1 back", "resumed_s": 9.27}, {"case": "(c) node 0 lost", "resumed_s": 9.02}]}


def test_a_mark_names_the_number_before_it_its_benchmark_key_and_options() -> None:
    found = fig.figures(PAGE)
    assert [(f.line, f.text, f.benchmark, f.key) for f in found] == [
        (5, "87.4", "goodput", "results.a.goodput"), (5, "243", "goodput", "results.a.wall_s"),
        (6, "1.11", "goodput", "results.a.goodput"), (6, "1,632", "goodput", "config.steps"),
        (7, "4.11", "recovery", "rows.b.*.phases_s.init() (cluster)"),
        (8, "9.3", "node_loss", "losses.case=(a) node 1 back.resumed_s"), (8, "194", "node_loss", "hello.plain")]
    percent, _, ratio, steps, *_, hello = found
    assert (percent.scale, percent.tolerance, percent.stated, percent.decimals) == (100.0, fig.TOLERANCE, 87.4, 1)
    assert (ratio.over, ratio.tolerance) == ("results.b.goodput", 0.0)
    assert (steps.stated, steps.decimals) == (1632.0, 0)
    line = PAGE.splitlines()[4]
    assert line[slice(*percent.span)] == "87.4" and line[slice(*found[1].span)] == "243"
    assert str(hello) == "node_loss hello.plain" and str(percent) == "goodput results.a.goodput ×100"
    assert fig.figures("a mark reads `<!-- figure goodput results.a.goodput -->`\n") == []  # an example


@pytest.mark.parametrize("line, says", [
    ("the goodput<!-- figure goodput results.a.goodput -->", "follows no number"),
    ("87.4 % (0.80–0.90)<!-- figure goodput results.a.goodput -->", "follows no number"),
    ("87.4 %<!-- figure goodput results.a.goodput scale=1O0 -->", "scale='1O0' is not a number"),
    ("87.4 %<!-- figure goodput results.a.goodput factor=100 -->", "unknown option 'factor=100'"),
    ("87.4 %<!-- figure goodput \"results.a -->", "No closing quotation"),
    ("87.4 %<!-- figure goodput -->", "a mark is <!-- figure BENCHMARK KEY"),
])
def test_a_mark_that_cannot_be_checked_is_an_error_naming_its_line(line: str, says: str) -> None:
    with pytest.raises(fig.MarkError, match=re.escape(says)) as raised:
        fig.figures(f"# title\n{line}\n", "perf.md")
    assert str(raised.value).startswith("perf.md:2: ")


def test_a_key_walks_dicts_and_lists_and_rounds_stand_for_their_median() -> None:
    data = {"rows": {"b": [{"s": 5.43}, {"s": 5.34}, {"s": 6.05}]}, "ratios": {"c/b": [1.74, 1.89, 1.94]},
            "losses": [{"case": "(a)", "s": 9.0}, {"case": "(c)", "s": 8.0}], "flag": True}
    assert fig.resolve(data, "rows.b.*.s") == [5.43, 5.34, 6.05]
    assert fig.resolve(data, "rows.b.1.s") == [5.34] and fig.resolve(data, "losses.case=(c).s") == [8.0]
    assert fig.resolve(data, "ratios.c/b") == [1.74, 1.89, 1.94]
    assert fig.measure(fig.Figure(1, (0, 4), "5.43", "recovery", "rows.b.*.s"), data) == 5.43
    for missing in ("rows.d.*.s", "rows.b.3.s", "losses.case=(b).s", "losses.kind=(a).s", "rows.b.*.t", "flag"):
        with pytest.raises(KeyError):
            fig.resolve(data, missing)
    # An item the short form does not run stands for every item of its list, for its field only.
    assert fig.resolve(data, "losses.case=(b).s", shape=True) == [9.0, 8.0]
    with pytest.raises(KeyError, match="nothing at 't'"):
        fig.resolve(data, "losses.case=(b).t", shape=True)


def test_a_figure_is_checked_within_its_tolerance_and_the_digits_the_page_gives() -> None:
    marked = fig.figures(PAGE)
    verdicts = {str(v.figure): v for v in fig.check(marked, {"goodput": GOODPUT, "recovery": RECOVERY})}
    assert verdicts["goodput results.a.goodput ×100"].status == "ok"
    assert verdicts["goodput results.a.goodput / results.b.goodput"].measured == pytest.approx(1.1097, abs=1e-4)
    assert verdicts["goodput results.a.goodput / results.b.goodput"].status == "ok"  # 1.11 stands for 1.105–1.115
    assert verdicts["recovery rows.b.*.phases_s.init() (cluster)"].measured == 4.11  # the median of three rounds
    assert {v.status for v in verdicts.values() if v.figure.benchmark == "node_loss"} == {"unchecked"}
    slower = {**GOODPUT, "results": {"a": {"goodput": 0.70, "wall_s": 243.3}, "b": {"goodput": 0.7878}}}
    drifted = {str(v.figure): v.status for v in fig.check(marked, {"goodput": slower}) if v.failed}
    assert drifted == {"goodput results.a.goodput ×100": "drifted",  # 87.4 against 70.0: 25 % off
                       "goodput results.a.goodput / results.b.goodput": "drifted"}  # exact: 1.11 against 0.889
    gone = fig.check(marked, {"goodput": {"benchmark": "goodput", "results": {}}})
    assert [v.status for v in gone if v.figure.benchmark == "goodput"] == ["gone"] * 4
    within_tolerance = fig.Figure(1, (0, 3), "9.3", "node_loss", "x", tolerance=0.25)
    assert fig.within(within_tolerance, 7.5) and not fig.within(within_tolerance, 7.4)


def test_writing_puts_each_measured_value_where_its_figure_was_in_the_pages_digits() -> None:
    marked = fig.figures(PAGE)
    # The first number of a line written shorter: the figures after it must still land in place.
    measured = {**GOODPUT, "config": {"steps": 12345}, "results": {"a": {"goodput": 0.09012, "wall_s": 1201.7},
                                                                  "b": {"goodput": 0.8}}}
    written = fig.rewrite(PAGE, fig.check(marked, {"goodput": measured}))
    lines = written.splitlines()
    assert lines[4] == ("| (a) | **9.0 %**<!-- figure goodput results.a.goodput scale=100 --> (0.80–0.90) | "
                        "1202 s<!-- figure goodput results.a.wall_s --> |")
    assert lines[5].startswith("Ratio **0.11**<!--") and "over 12,345 steps<!--" in lines[5]
    assert lines[6:] == PAGE.splitlines()[6:]  # no JSON for these: left as they were
    assert [f.text for f in fig.figures(written)][:4] == ["9.0", "1202", "0.11", "12,345"]


def test_a_short_forms_json_contradicts_the_page_only_by_a_missing_key_or_an_exact_figure() -> None:
    marked = fig.figures(PAGE)
    short = {"benchmark": "node_loss", "hello": {"plain": 194},
             "losses": [{"case": "(c) node 0 lost", "resumed_s": 3.0}]}
    assert fig.short_form_problems(marked, short) == []  # (a) is not run: its field is there in (c)
    renamed = {**short, "losses": [{"case": "(c) node 0 lost", "resumed": 3.0}], "hello": {"plain": 201}}
    assert fig.short_form_problems(marked, renamed) == [
        "line 8: losses.case=(a) node 1 back.resumed_s: nothing at 'resumed_s'",
        "line 8: node_loss hello.plain is 194 on the page, 201 here"]
    assert fig.short_form_problems(marked, {"benchmark": "goodput", "config": {"steps": 16}, "results": {
        "a": {"goodput": 0.5, "wall_s": 9.0}, "b": {"goodput": 0.5}}}) == [
        "line 6: goodput results.a.goodput / results.b.goodput is 1.11 on the page, 1 here"]


def test_the_command_checks_writes_and_says_what_drifted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page, results = tmp_path / "perf.md", tmp_path / "results"
    page.write_text(PAGE)
    results.mkdir()
    for data in (GOODPUT, RECOVERY, NODE_LOSS):
        (results / f"{data['benchmark']}.json").write_text(json.dumps(data))
    assert fig.main(["--check", str(results), "--page", str(page)]) == 0
    out = capsys.readouterr().out
    assert ("perf.md:5 goodput results.a.goodput ×100: the page 87.4, measured 87.42 (0.0 % off, tolerance 15 %): "
            "ok") in out
    assert out.splitlines()[-1] == "7 figures: 0 drifted or gone, 0 not checked"
    (results / "node_loss.json").write_text(json.dumps({**NODE_LOSS, "losses": [{"case": "(a) node 1 back",
                                                                                "resumed_s": 14.0}]}))
    (results / "recovery.json").unlink()
    assert fig.main(["--check", str(results), "--page", str(page)]) == 1
    out = capsys.readouterr().out
    assert "perf.md:8 node_loss losses.case=(a) node 1 back.resumed_s: the page 9.3, measured 14.00 (33.6 % off, " \
           "tolerance 25 %): DRIFTED" in out
    assert "perf.md:7 recovery rows.b.*.phases_s.init() (cluster): not checked (no recovery.json" in out
    assert fig.main(["--write", str(results), "--page", str(page)]) == 0
    assert "came back in\n14.0 s<!--" in page.read_text() and "wrote 6 figures" in capsys.readouterr().out
    (results / "short.json").write_text(json.dumps({"benchmark": "goodput", "results": {"a": {}, "b": {}}}))
    assert fig.main(["--keys", str(results / "short.json"), "--page", str(page)]) == 1
    assert "4 figures of 'goodput' marked in perf.md: 5 contradicted" in capsys.readouterr().out
    page.write_text("87.4 %<!-- figure goodput -->\n")
    assert fig.main(["--check", str(results), "--page", str(page)]) == 2


def test_the_performance_pages_marks_name_benchmarks_that_write_them() -> None:
    marked = fig.figures(fig.PAGE.read_text(encoding="utf-8"), "docs/performance.md")
    benchmarks = {f.benchmark for f in marked}
    assert {"goodput", "recovery", "node_loss"} <= benchmarks, f"marked: {sorted(benchmarks)}"
    for name in benchmarks:
        script = ROOT / "bench" / f"{name}.py"
        assert script.exists() and f'"benchmark": "{name}"' in script.read_text(), \
            f"docs/performance.md marks figures of {name!r}, which no benchmark writes"
    assert all(0 <= f.tolerance < 1 and f.scale > 0 for f in marked)


def test_every_benchmark_the_page_marks_has_its_keys_checked_on_its_short_form() -> None:
    benchmarks = {f.benchmark for f in fig.figures(fig.PAGE.read_text(encoding="utf-8"))}
    tests = "".join(path.read_text() for path in sorted((ROOT / "tests" / "integration" / "bench").glob("test_*.py")))
    checked = {name for body in tests.split("\ndef test_")
               if '"figures.py", "--keys"' in body for name in re.findall(r'run_bench\("(\w+)\.py"', body)}
    assert benchmarks <= checked, f"no short form runs bench/figures.py --keys for {sorted(benchmarks - checked)}"
