"""Every test starts from a clean environment and must leave no process or mindft thread behind.
A test marked ``mindspore`` is in the slow tier too."""
from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from mindft.agent.memory import stale_memory
from mindft.snapshot.store import SnapshotStore

from harness import ExampleReferences, Processes, free_port_pair
from readme_figures import TIME_TOLERANCE, off_by, readme_figures

# Variables that configure mindft or MindSpore's cluster: a developer's shell must not leak into tests.
_ISOLATED = re.compile(r"^(MS_|MINDFT_|MINDIO_|MINDX_|RANK_|DEVICE_ID$|RANK_ID$|RANK_SIZE$|VC_TASK_INDEX$)")
_GRACE = 5.0  # seconds a test's threads and processes get to finish after it
_FAST = 2.0  # seconds a test of the fast tier may take (a test that takes longer belongs in the slow tier)
_slow_but_unmarked: list[tuple[str, float]] = []
_session_started = time.monotonic()


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _mindft_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("mindft")}


# Shared fixtures: `launch` (one mindft-launch of fake ranks). Helper modules live beside this file
# (harness, launching, dp_jobs, sim, explore, ...), never directly in tests/unit/ or tests/integration/:
# a module or conftest there would put that folder on sys.path, and its package-named folders
# (mindio/, mindspore/) would answer imports such as MindSpore's optional `import mindio`.
pytest_plugins = ["launching"]

_UNIT = Path(__file__).resolve().parent / "unit"
_INTEGRATION = Path(__file__).resolve().parent / "integration"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    # The tier is the folder: a slow test under tests/unit/ would slip into the fast tier's
    # `pytest tests/unit`. It is refused where it is collected, so the error names its module.
    outcome = yield
    report = outcome.get_result()
    if report.passed and _UNIT in Path(collector.path).parents:
        misplaced = [item.nodeid for item in report.result if isinstance(item, pytest.Item) and
                     (item.get_closest_marker("slow") or item.get_closest_marker("mindspore"))]
        if misplaced:
            report.outcome = "failed"
            report.longrepr = "\n".join(
                f"{nodeid}: marked slow or mindspore under tests/unit/, the fast tier; move it to tests/integration/"
                for nodeid in misplaced)
            report.result = []


# The longest modules, longest first (docs/testing.md has their times: 4 minutes to 40 s on a worker). With --dist
# loadfile a module runs whole on one worker, and a worker takes the next module in collection
# order once it is free: these are collected first, so that neither worker starts one of them
# while the other has nothing left to do. A module that grows past ~4 minutes is split instead.
_LONGEST_FIRST = tuple(_INTEGRATION / path for path in (
    "mindformers/test_mindformers.py", "agent/test_two_hosts.py", "agent/test_elastic_hosts.py",
    "bench/test_bench_elastic.py", "agent/test_three_hosts.py",
    "mindspore/test_dp_recovery.py", "bench/test_bench_costs.py", "bench/test_bench_recoveries.py",
    "cli/test_launch.py", "mindio/test_mindio_backend.py",
    "mindspore/test_dp_failures.py", "mindio/test_mindio_recovery.py", "mindspore/test_mindspore_recovery.py",
    "controller/test_coordination.py", "agent/test_cluster.py", "mindspore/test_slow_ranks.py",
    "flow/test_explore_seeds.py",
))
assert all(path.is_file() for path in _LONGEST_FIRST), \
    f"tests/conftest.py's _LONGEST_FIRST names a module that is gone: {[str(p) for p in _LONGEST_FIRST if not p.is_file()]}"


def _schedule_rank(item: pytest.Item) -> int:
    path = Path(item.path)
    return _LONGEST_FIRST.index(path) if path in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The tier is the folder: tests/integration/ is the slow tier. MindSpore takes seconds to import
    # (more on busy cores): its tests are never in the fast tier either.
    for item in items:
        if _INTEGRATION in Path(item.path).parents or item.get_closest_marker("mindspore"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_schedule_rank)  # stable: every other module keeps its place


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > _FAST and "slow" not in report.keywords:
        _slow_but_unmarked.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    # Not a failure: on a busy machine a fast test can take longer. A test that always does
    # belongs in the slow tier.
    if _slow_but_unmarked:
        terminalreporter.write_sep("-", f"not marked slow but took over {_FAST:g} s")
        for nodeid, seconds in sorted(_slow_but_unmarked, key=lambda row: -row[1]):
            terminalreporter.write_line(f"{seconds:6.2f}s {nodeid}")
    _compare_with_the_readme(terminalreporter, config)
    if not hasattr(config, "workerinput"):
        # What the suite's SIGKILLed agents left in /dev/shm: the next launcher on the host removes it.
        left = stale_memory()
        terminalreporter.write_sep("-", f"memory directories of dead launchers left in shared memory: {len(left)}"
                                        + (f" ({', '.join(d.name for d in left)})" if left else ""))


def _compare_with_the_readme(terminalreporter, config: pytest.Config) -> None:
    """After the whole suite or the fast tier, unfiltered: its time against the README's figure. Said,
    not failed: a machine's speed is no test's verdict (the counts are a test's: test_docs_figures.py)."""
    tier = {("tests",): "whole suite", (): "whole suite", ("tests/unit",): "fast tier"}.get(
        tuple(a.rstrip("/") for a in config.args if a != str(config.rootpath)))
    if tier is None or config.option.keyword or config.option.markexpr:
        return
    figures = readme_figures()
    stated = figures.suite_seconds if tier == "whole suite" else figures.fast_seconds
    took = time.monotonic() - _session_started
    verdict = "within" if off_by(stated, took) <= TIME_TOLERANCE else "OUTSIDE: update the README's figure, or say why"
    terminalreporter.write_sep("-", f"the README says the {tier} takes ~{stated:g} s on 2 cores; this run took "
                                    f"{took:.0f} s ({verdict} {100 * TIME_TOLERANCE:.0f}%)")


def _isolate(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if _ISOLATED.match(name):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True, scope="session")
def isolated_session() -> Iterator[None]:
    """The same for module- and session-scoped fixtures (reference runs), set up before any test's own."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _isolate(monkeypatch)
        yield


@pytest.fixture(autouse=True)
def isolated_environment(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    _isolate(monkeypatch)
    if not request.node.get_closest_marker("mindspore"):
        # The launcher's warm process imports what its workers do: the test ranks need numpy, not
        # MindSpore (seconds of CPU for every launch). Tests of MindSpore jobs preload MindSpore.
        monkeypatch.setenv("MINDFT_PRELOAD", "numpy")
    yield


@pytest.fixture(autouse=True)
def no_leaks():
    children, threads = _children(), _mindft_threads()
    yield
    deadline = time.monotonic() + _GRACE
    while True:
        new_children = {p for p in _children() - children if _alive(p)}
        new_threads = {t for t in _mindft_threads() - threads if t.is_alive()}
        if not (new_children or new_threads) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in new_children:  # do not let one test's leftovers break the next ones
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not new_children, f"the test left child processes running: {sorted(new_children)}"
    assert not new_threads, f"the test left mindft threads running: {sorted(t.name for t in new_threads)}"


@pytest.fixture(scope="session")
def example_references(tmp_path_factory: pytest.TempPathFactory) -> ExampleReferences:
    """The examples' fault-free weights, shared by the modules that compare with them (one run per worker)."""
    return ExampleReferences(tmp_path_factory.mktemp("example-references"))


@pytest.fixture
def processes() -> Iterator[Processes]:
    """Commands a test starts, killed with their process groups afterwards."""
    tracker = Processes()
    yield tracker
    tracker.kill_all()


@pytest.fixture
def store() -> Iterator[SnapshotStore]:
    """An in-memory snapshot store, closed afterwards."""
    with SnapshotStore() as created:
        yield created


@pytest.fixture
def listener() -> Iterator[tuple[int, int]]:
    """A port some other process listens on (this test's), and its pid."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port_pair()))
        sock.listen()
        yield sock.getsockname()[1], os.getpid()
