"""The device plugin's reset file: tolerant parsing and change-only device events."""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from mindft.resetwatch import (
    DeviceFailed,
    DeviceFaulty,
    DeviceRecovered,
    ResetFileError,
    ResetState,
    ResetWatcher,
    fault_state,
    parse_reset,
    read_reset_file,
    render_reset,
    write_reset_file,
)

# The shape documented for reset-config-<job name>, with fields mindft does not use.
DOCUMENTED = {
    "RankList": [{"RankId": 3, "LogicId": 3, "Status": "unrecovered", "Policy": "reset",
                  "InitialPolicy": "restart_request", "ErrorCode": [2162169857],
                  "ErrorCodeHex": "0x80E01801", "SomethingNew": True}],
    "RetryTime": 2, "GracefulExit": 0, "UpdateTime": 1764680000, "FaultFlushing": False,
    "RestartFaultProcess": False, "restartType": "hotReset", "checkCode": "abc",
}


def _write(path: Path, document: object) -> None:
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("text, expected", [
    (json.dumps(DOCUMENTED), [(3, "unrecovered", "reset", "0x80E01801")]),
    ('{"RankList": [], "RetryTime": 0, "GracefulExit": 0}', []),
    ('{"RankList": null}', []),
    ("{}", []),
    # RankId as a string, ErrorCode as a single number and no hex: tolerated.
    ('{"RankList": [{"RankId": "5", "Status": "recovered", "Policy": "restart", "ErrorCode": 2162169857}]}',
     [(5, "recovered", "restart", "0x80E01801")]),
    # An entry without RankId is skipped, the rest is kept; ranks come out sorted.
    ('{"RankList": [{"RankId": 2, "Status": "failed", "Policy": "isolate", "ErrorCodeHex": "0x1"},'
     ' {"Status": "unrecovered"}, {"RankId": 0, "Status": "Unrecovered", "Policy": "reset"}]}',
     [(0, "unrecovered", "reset", ""), (2, "failed", "isolate", "0x1")]),
])
def test_parse_table(text: str, expected: list[tuple[int, str, str, str]]) -> None:
    state = parse_reset(text)
    assert [(r.rank, r.status, r.policy, r.error_code) for r in state.ranks] == expected


def test_parse_keeps_top_level_fields() -> None:
    state = parse_reset(json.dumps(DOCUMENTED))
    assert state.retry_time == 2
    assert state.graceful_exit is False
    assert state.extra["restartType"] == "hotReset"
    assert state.rank(3) is not None and state.rank(3).initial_policy == "restart_request"
    assert state.rank(4) is None


@pytest.mark.parametrize("text", [
    "",                                     # truncated to nothing while being rewritten
    '{"RankList": [{"RankId": 1, "Sta',     # half-written
    "not json",
    "[1, 2]",                               # not an object
    '{"RankList": {"RankId": 1}}',          # RankList not a list
    '{"RankList": [{"RankId": "x"}]}',      # RankId not a number
    '{"RankList": [{"RankId": -1}]}',
    '{"RankList": [], "RetryTime": "soon"}',
])
def test_parse_rejects_bad_text(text: str) -> None:
    with pytest.raises(ResetFileError):
        parse_reset(text)


def test_write_then_read_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "reset.json"
    state = fault_state([2, 1], error_code=0x80E01801, policy="reset", retry_time=1)
    write_reset_file(path, state)
    assert [p.name for p in path.parent.iterdir()] == ["reset.json"]  # no temporary left behind
    document = json.loads(path.read_text())
    assert [entry["RankId"] for entry in document["RankList"]] == [1, 2]
    assert document["RankList"][0]["Status"] == "unrecovered"
    assert document["RankList"][0]["ErrorCode"] == [0x80E01801]
    assert document["RankList"][0]["ErrorCodeHex"] == "0x80E01801"
    assert document["RetryTime"] == 1 and document["GracefulExit"] == 0
    again = read_reset_file(path)
    assert again.ranks == state.ranks
    assert parse_reset(render_reset(again)).ranks == state.ranks


def test_fault_state_rejects_unknown_status() -> None:
    with pytest.raises(ValueError, match="unrecovered, recovered, failed"):
        fault_state([0], "broken")


def test_event_sequence_fault_recovered_failed(tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    watcher = ResetWatcher(path, poll_interval=0.01)
    assert watcher.poll() == []                       # missing: nothing to report
    write_reset_file(path, fault_state([1], policy="reset"))
    assert watcher.poll() == [DeviceFaulty(1, "0x80E01801", "reset")]
    assert watcher.faulty_ranks == (1,)
    assert watcher.poll() == []                       # unchanged file: no repeat
    write_reset_file(path, fault_state([1], policy="reset"))  # rewritten, same state
    assert watcher.poll() == []
    write_reset_file(path, fault_state([1], "recovered"))
    assert watcher.poll() == [DeviceRecovered(1)]
    assert watcher.faulty_ranks == ()
    write_reset_file(path, fault_state([1, 2], "unrecovered"))
    assert watcher.poll() == [DeviceFaulty(1, "0x80E01801", "restart_request"),
                              DeviceFaulty(2, "0x80E01801", "restart_request")]
    write_reset_file(path, ResetState(ranks=(fault_state([1], "failed").ranks[0],
                                             fault_state([2], "unrecovered").ranks[0])))
    events = watcher.poll()
    assert len(events) == 1 and isinstance(events[0], DeviceFailed) and events[0].rank == 1
    assert "0x80E01801" in events[0].reason
    assert watcher.failed_ranks == (1,)


def test_recovered_at_start_is_not_an_event(tmp_path: Path) -> None:
    # A stale "recovered" entry left from an earlier fault must not look like news.
    path = tmp_path / "reset.json"
    write_reset_file(path, fault_state([0], "recovered"))
    assert ResetWatcher(path, 0.01).poll() == []


def test_rank_dropped_from_list_counts_as_recovered(tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    watcher = ResetWatcher(path, 0.01)
    write_reset_file(path, fault_state([0, 3]))
    assert [e.rank for e in watcher.poll()] == [0, 3]
    write_reset_file(path, fault_state([3]))
    assert watcher.poll() == [DeviceRecovered(0)]


def test_ignore_policy_is_not_a_fault(tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    write_reset_file(path, fault_state([0], policy="ignore"))
    assert ResetWatcher(path, 0.01).poll() == []


def test_graceful_exit_fails_listed_ranks(tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    watcher = ResetWatcher(path, 0.01)
    write_reset_file(path, fault_state([2]))
    assert watcher.poll() == [DeviceFaulty(2, "0x80E01801", "restart_request")]
    write_reset_file(path, fault_state([2], graceful_exit=True))
    [event] = watcher.poll()
    assert isinstance(event, DeviceFailed) and event.rank == 2 and "GracefulExit" in event.reason


def test_bad_files_keep_last_state_and_log_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "reset.json"
    watcher = ResetWatcher(path, 0.01)
    write_reset_file(path, fault_state([1]))
    assert len(watcher.poll()) == 1
    caplog.set_level(logging.DEBUG, logger="mindft.resetwatch")
    for text in ['{"RankList": [{"RankId": 1, "Status": "recov', '{"RankList": [{"RankId": 1, "Status": "recov']:
        path.write_text(text)
        assert watcher.poll() == []
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert watcher.poll() == []
    path.unlink()
    assert watcher.poll() == [] and watcher.poll() == []
    assert watcher.faulty_ranks == (1,)               # a bad read changes nothing
    warnings = [r for r in caplog.records if "reading again" in r.getMessage()]
    assert len(warnings) == 3                          # half-written once, bad bytes once, missing once
    write_reset_file(path, fault_state([1], "recovered"))
    assert watcher.poll() == [DeviceRecovered(1)]


def test_unknown_status_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    _write(path, {"RankList": [{"RankId": 0, "Status": "resetting", "Policy": "reset"}]})
    assert ResetWatcher(path, 0.01).poll() == []


def test_directory_instead_of_file_never_raises(tmp_path: Path) -> None:
    (tmp_path / "reset.json").mkdir()
    assert ResetWatcher(tmp_path / "reset.json", 0.01).poll() == []


def test_thread_delivers_events_and_survives_a_bad_handler(tmp_path: Path) -> None:
    path = tmp_path / "reset.json"
    watcher = ResetWatcher(path, poll_interval=0.01)
    seen: list[object] = []
    got_two = threading.Event()

    def handler(event: object) -> None:
        seen.append(event)
        if len(seen) == 1:
            raise RuntimeError("handler bug")  # must not kill the watcher thread
        got_two.set()

    watcher.start(handler)
    try:
        write_reset_file(path, fault_state([0]))
        for _ in range(500):
            if seen:
                break
            threading.Event().wait(0.01)
        path.write_text("{half")
        write_reset_file(path, fault_state([0], "recovered"))
        assert got_two.wait(5.0)
    finally:
        watcher.stop()
    assert seen == [DeviceFaulty(0, "0x80E01801", "restart_request"), DeviceRecovered(0)]


def test_rejects_non_positive_interval(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ResetWatcher(tmp_path / "reset.json", 0)
