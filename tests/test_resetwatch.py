"""The reset file as Huawei's writers produce it: parsing, episode semantics, both mount layouts."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from plugin_files import (INITIAL, HostPathMount, KubeletMount, check_code, clusterd_entry, document, go_marshal,
                          legacy, plugin_entry, plugin_episode)

import mindft.resetwatch as resetwatch
from mindft.resetwatch import (
    DEVICE_EVENTS,
    DeviceFailed,
    DeviceFaulty,
    DeviceRecovered,
    FaultFlushing,
    GracefulExit,
    ProcessFault,
    ResetFileError,
    ResetState,
    ResetWatcher,
    RestartAll,
    fault_state,
    parse_reset,
    read_reset_file,
    render_reset,
    write_reset_file,
)

UCE = "0x80E01801"


@pytest.fixture
def mount(tmp_path: Path) -> HostPathMount:
    return HostPathMount(tmp_path / "default.reset-config-job")


@pytest.fixture
def watcher(mount: HostPathMount) -> ResetWatcher:
    return ResetWatcher(mount.path, poll_interval=0.01)


def _ring(first: int, count: int = 8) -> list[int]:
    return list(range(first, first + count))


# ---- parsing ---------------------------------------------------------------------------------------

def test_parse_plugin_file_every_field() -> None:
    data = go_marshal(document([plugin_entry(3, "unrecovered", "reset", "restart_request",
                                             codes=(0x8C03A000, 0x80E18404), logic_id=3),
                                plugin_entry(2, "unrecovered", "reset", "restart_request", codes=())],
                               retry_time=2))
    assert data.startswith(b'{"RankList":[{"RankId":3,"LogicId":3,"Status":"unrecovered","Policy":"reset",'
                           b'"InitialPolicy":"restart_request","ErrorCode":[],"ErrorCodeHex":"8C03A000,80E18404"}')
    state = parse_reset(data)
    assert [entry.rank for entry in state.ranks] == [2, 3]
    three = state.rank(3)
    assert three is not None
    assert (three.status, three.policy, three.initial_policy, three.logic_id) == \
        ("unrecovered", "reset", "restart_request", 3)
    assert three.error_codes == (0x8C03A000, 0x80E18404)
    assert three.error_code == "0x8C03A000,0x80E18404"
    assert state.rank(2) is not None and state.rank(2).error_code == ""  # a healthy ring-mate
    assert (state.retry_time, state.update_time, state.fault_flushing, state.graceful_exit,
            state.restart_fault_process, state.list_cleared) == (2, 1764680000, False, False, False, False)


@pytest.mark.parametrize("hex_text, codes", [
    ("8C03A000,80E18404", (0x8C03A000, 0x80E18404)),
    ("800000F", (0x0800000F,)),            # the plugin before mid-2026: no leading zeros
    ("0800000F", (0x0800000F,)),           # since then: kept
    ("0x80E01801, 0X8c204e00", (0x80E01801, 0x8C204E00)),
    ("", ()),
])
def test_error_code_hex_lists(hex_text: str, codes: tuple[int, ...]) -> None:
    entry = dict(plugin_entry(0, "unrecovered", "restart"), ErrorCodeHex=hex_text)
    assert parse_reset(go_marshal(document([entry]))).ranks[0].error_codes == codes


@pytest.mark.parametrize("rank_list, cleared", [([], True), (None, True)])
def test_empty_and_null_rank_lists_are_a_cleared_list(rank_list: Any, cleared: bool) -> None:
    state = parse_reset(go_marshal(document(rank_list)))
    assert state.ranks == () and state.list_cleared is cleared


def test_initial_content_says_nothing_about_ranks() -> None:
    state = parse_reset(INITIAL)
    assert state.ranks == () and not state.list_cleared and state.extra == {"status": "initializing"}


def test_clusterd_entry_with_nulls() -> None:
    state = parse_reset(go_marshal(document([clusterd_entry(5)], restart_fault_process=True)))
    [entry] = state.ranks
    assert (entry.rank, entry.status, entry.policy, entry.initial_policy, entry.error_codes) == \
        (5, "fault", "", "", ())
    assert state.restart_fault_process is True


def test_hand_written_fixture_nulls_and_decimal_codes() -> None:
    entry = {"RankId": 1, "LogicId": 1, "Status": "unrecovered", "Policy": "restart_request",
             "InitialPolicy": None, "ErrorCode": [2162169857], "ErrorCodeHex": None, "Extra": {"x": [1]}}
    [parsed] = parse_reset(go_marshal(document([entry]))).ranks
    assert (parsed.initial_policy, parsed.error_code) == ("", UCE)


def test_legacy_file() -> None:
    state = parse_reset(legacy([{"RankId": 4, "Status": "unrecovered", "Policy": "reset"}]))
    assert [entry.rank for entry in state.ranks] == [4]
    assert state.retry_time == 0 and state.update_time == 1764680000
    assert parse_reset(legacy(None)).list_cleared


def test_unknown_keys_are_ignored() -> None:
    entry = dict(plugin_entry(0, "unrecovered", "reset"), NewField={"a": [1, 2]}, Other=None)
    data = go_marshal(dict(document([entry]), SomethingNew=[{"deep": {"er": 1}}], checkCode="abc"))
    state = parse_reset(data)
    assert state.rank(0) is not None and state.rank(0).policy == "reset"
    assert set(state.extra) == {"SomethingNew", "checkCode"}


@pytest.mark.parametrize("bad_entry", [
    {"RankId": -1, "LogicId": 0, "Status": "unrecovered", "Policy": "reset"},   # inference layout
    {"LogicId": 2, "Status": "unrecovered"},                                    # no RankId
    {"RankId": "x", "Status": "unrecovered"},
    {"RankId": 4294967296, "Status": "unrecovered"},
    {"RankId": True, "Status": "unrecovered"},
    {"RankId": 1.5, "Status": "unrecovered"},
    {"RankId": 9, "Status": ["unrecovered"]},
    {"RankId": 9, "Status": "unrecovered", "Policy": "x" * 500},
    {"RankId": 9, "Status": "unrecovered\ud800"},
    {"RankId": 9, "Status": "unrecovered", "ErrorCodeHex": "ZZ"},
    {"RankId": 9, "Status": "unrecovered", "ErrorCodeHex": "1" * 17},
    {"RankId": 9, "Status": "unrecovered", "ErrorCode": ["a"]},
    {"RankId": 9, "Status": "unrecovered", "LogicId": "eight"},
    "not an object",
    None,
    [1, 2],
])
def test_a_bad_entry_costs_that_entry_only(bad_entry: Any) -> None:
    good = plugin_entry(7, "unrecovered", "reset")
    data = json.dumps({"RankList": [good, bad_entry, dict(good, RankId=6)], "RetryTime": 1}).encode()
    state = parse_reset(data)
    assert [entry.rank for entry in state.ranks] == [6, 7]
    assert state.skipped == 1 and not state.list_cleared


def test_rank_id_given_as_text_is_tolerated() -> None:
    assert parse_reset(b'{"RankList":[{"RankId":"5","Status":"recovered"}]}').ranks[0].rank == 5


@pytest.mark.parametrize("data, kind", [
    (b"", "empty"),
    (b"   \n", "empty"),
    (plugin_episode([0, 1], "unrecovered", retry_time=1)[:-1], "invalid JSON"),   # cut short
    (plugin_episode([0, 1], "unrecovered", retry_time=1)[:40], "invalid JSON"),
    (b"not json", "invalid JSON"),
    (b"[1, 2]", "not an object"),
    (b'"text"', "not an object"),
    (b'{"RankList":{"RankId":1}}', "bad field"),
    (b'{"RankList":[],"RetryTime":"soon"}', "bad field"),
    (b'{"RankList":[],"RetryTime":-1}', "bad field"),
    (b'{"RankList":[],"FaultFlushing":"yes"}', "bad field"),
    (b'{"RankList":[],"GracefulExit":[1]}', "bad field"),
    (b'{"RankList":[],"RestartFaultProcess":2}', "bad field"),
    (b'{"RankList":[],"RetryTime":NaN}', "invalid JSON"),
    (b'{"RankList":[{"RankId":' + b"7" * 5000 + b"}]}", "number too long"),
    (b'{"RankList":[],"RetryTime":1' + b"0" * 30 + b"}", "number too long"),
    (b'{"RankList":[],"UpdateTime":1.' + b"5" * 100 + b"}", "number too long"),
    (b"[" * 100_000 + b"]" * 100_000, "too deep"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "too deep"),
    (b"[" * 100_000, "too deep"),
    (b'{"RankList":[],"x":"' + b"a" * (1 << 20) + b'"}', "too large"),
    (b'{"RankList":[],"x":"\xff\xfe"}', "not UTF-8"),
    ('{"RankList":[]}'.encode("utf-16"), "not UTF-8"),
])
def test_bad_reads(data: bytes, kind: str) -> None:
    with pytest.raises(ResetFileError) as caught:
        parse_reset(data)
    assert caught.value.kind == kind


def test_depth_check_ignores_brackets_in_strings() -> None:
    data = go_marshal(dict(document([plugin_entry(0, "unrecovered", "reset")]), Note="[" * 1000 + '\\"{' * 50))
    assert parse_reset(data).rank(0) is not None


def test_check_code_verifies_the_exact_bytes() -> None:
    data = plugin_episode([0], "unrecovered", retry_time=1)
    assert parse_reset(data, check_code=check_code(data)).rank(0) is not None
    assert parse_reset(data, check_code=check_code(data).upper() + "\n").rank(0) is not None
    with pytest.raises(ResetFileError) as caught:
        parse_reset(data, check_code=check_code(data + b" "))
    assert caught.value.kind == "checkCode mismatch"


def test_render_is_the_plugins_bytes() -> None:
    state = fault_state([1, 0], "unrecovered", policy="reset", retry_time=3, initial_policy="restart_request")
    state = ResetState(ranks=tuple(
        resetwatch.ResetRank(e.rank, e.status, e.policy, e.initial_policy, e.error_codes, e.error_code_hex,
                             logic_id=e.rank % 8) for e in state.ranks), retry_time=3, update_time=1764680000)
    expected = plugin_episode([0, 1], "unrecovered", "reset", retry_time=3, initial_policy="restart_request")
    assert render_reset(state).encode() == expected
    assert parse_reset(expected).ranks == state.ranks


def test_fault_state_rejects_unknown_status() -> None:
    with pytest.raises(ValueError, match="unrecovered, recovered, failed, fault"):
        fault_state([0], "broken")


# ---- events: every status and policy ---------------------------------------------------------------

@pytest.mark.parametrize("status, policy, expected", [
    ("unrecovered", "restart_request", DeviceFaulty(0, UCE, "restart_request")),
    ("unrecovered", "restart", DeviceFaulty(0, UCE, "restart")),
    ("unrecovered", "reset", DeviceFaulty(0, UCE, "reset")),
    ("unrecovered", "isolate", DeviceFailed(0, "")),
    ("failed", "isolate", DeviceFailed(0, "")),
    ("failed", "reset", DeviceFailed(0, "")),
    ("unrecovered", "ignore", None),
    ("unrecovered", "empty", None),
    ("unrecovered", "free_reset", None),
    ("recovered", "reset", None),               # a past recovery is not news
    ("resetting", "reset", None),               # unknown status
])
def test_status_and_policy_to_event(mount: HostPathMount, watcher: ResetWatcher, status: str, policy: str,
                                    expected: Optional[object]) -> None:
    mount.write(plugin_episode([0], status, policy, retry_time=1))
    events = watcher.poll()
    if expected is None:
        assert events == []
    elif isinstance(expected, DeviceFailed):
        [event] = events
        assert isinstance(event, DeviceFailed) and event.rank == 0 and policy in event.reason
    else:
        assert events == [expected]
        assert events[0].retry_time == 1 and events[0].initial_policy == policy and events[0].logic_id == 0


def test_a_plugin_episode(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(INITIAL, restart_type="hotReset")
    assert watcher.poll() == []
    ring = _ring(0)
    mount.write(plugin_episode(ring, "unrecovered", "restart_request", retry_time=1))
    assert watcher.poll() == [DeviceFaulty(rank, UCE, "restart_request") for rank in ring]
    assert watcher.faulty_ranks == tuple(ring)
    # L2 did not clear in 30 s: the plugin escalates to a reset; same episode, nothing new to do.
    mount.write(plugin_episode(ring, "unrecovered", "reset", retry_time=1, initial_policy="restart_request"))
    assert watcher.poll() == []
    mount.write(plugin_episode(ring, "recovered", "reset", retry_time=1, initial_policy="restart_request"))
    events = watcher.poll()
    assert events == [DeviceRecovered(rank) for rank in ring]
    assert {event.cause for event in events} == {"recovered"}
    assert watcher.faulty_ranks == ()
    mount.write(go_marshal(document([plugin_entry(r, "recovered", "reset") for r in ring], retry_time=1,
                                    update_time=1764680099)))
    assert watcher.poll() == []                  # the record stays "recovered": no repeat
    assert watcher.restart_type == "hotReset"


def test_a_rank_overwritten_by_another_node_is_not_recovered(mount: HostPathMount, watcher: ResetWatcher) -> None:
    node_a, node_b = _ring(0), _ring(8)
    mount.write(plugin_episode(node_a, "unrecovered", retry_time=1))
    assert len(watcher.poll()) == 8
    mount.write(plugin_episode(node_b, "unrecovered", retry_time=2))   # last writer wins
    events = watcher.poll()
    assert events == [DeviceFaulty(rank, UCE, "reset") for rank in node_b]
    assert watcher.faulty_ranks == tuple(node_a + node_b)
    mount.write(plugin_episode(node_a, "recovered", retry_time=2))
    assert watcher.poll() == [DeviceRecovered(rank) for rank in node_a]
    assert watcher.faulty_ranks == tuple(node_b)
    mount.write(plugin_episode(node_b, "recovered", retry_time=2))
    assert watcher.poll() == [DeviceRecovered(rank) for rank in node_b]


def test_a_node_that_finds_the_job_in_reset_elsewhere_writes_isolate(mount: HostPathMount,
                                                                     watcher: ResetWatcher) -> None:
    mount.write(plugin_episode([0, 1], "unrecovered", retry_time=1))
    watcher.poll()
    mount.write(plugin_episode([8], "failed", "isolate", retry_time=1, initial_policy="reset"))
    [event] = watcher.poll()
    assert isinstance(event, DeviceFailed) and event.rank == 8
    assert watcher.faulty_ranks == (0, 1) and watcher.failed_ranks == (8,)


def test_a_cleared_list_after_a_reschedule_closes_the_episode(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(plugin_episode([2, 3], "unrecovered", retry_time=4))
    watcher.poll()
    mount.write(plugin_episode([5], "failed", "isolate", retry_time=4))
    watcher.poll()
    mount.write(go_marshal(document([], retry_time=4)))
    events = watcher.poll()
    assert events == [DeviceRecovered(2), DeviceRecovered(3), DeviceRecovered(5)]
    assert {event.cause for event in events} == {"cleared"}
    assert watcher.faulty_ranks == () and watcher.failed_ranks == ()


def test_a_list_of_unusable_entries_is_not_a_cleared_list(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(plugin_episode([2], "unrecovered", retry_time=1))
    watcher.poll()
    mount.write(go_marshal(document([plugin_entry(-1, "unrecovered", "reset")], retry_time=2)))
    assert watcher.poll() == [] and watcher.faulty_ranks == (2,)


def test_clusterd_flushing_fault_and_restart_all(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([], retry_time=0)))
    assert watcher.poll() == []
    mount.write(go_marshal(document([], retry_time=0, fault_flushing=True)))
    assert watcher.poll() == [FaultFlushing(True)]
    assert watcher.fault_flushing
    mount.write(go_marshal(document([clusterd_entry(3), clusterd_entry(1)], retry_time=0,
                                    restart_fault_process=True)))
    assert watcher.poll() == [ProcessFault(1, True), ProcessFault(3, True), FaultFlushing(False)]
    assert watcher.process_fault_ranks == (1, 3)
    mount.write(go_marshal(document([], retry_time=0, fault_flushing=True)))
    assert watcher.poll() == [FaultFlushing(True)]     # flushing again: the faults stay open
    assert watcher.process_fault_ranks == (1, 3)
    mount.write(go_marshal(document([], retry_time=1)), restart_type="hotReset")
    events = watcher.poll()
    assert events == [DeviceRecovered(1), DeviceRecovered(3), FaultFlushing(False), RestartAll(1)]
    assert {e.cause for e in events if isinstance(e, DeviceRecovered)} == {"restart_all"}
    assert events[-1].restart_type == "hotReset"
    assert watcher.process_fault_ranks == ()


def test_clusterd_fault_restarting_every_process(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([clusterd_entry(2)], retry_time=3, restart_fault_process=False)))
    assert watcher.poll() == [ProcessFault(2, False)]
    mount.write(go_marshal(document([], retry_time=4)))
    assert watcher.poll() == [DeviceRecovered(2), RestartAll(4)]


def test_restart_all_at_the_first_read_is_history(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([], retry_time=5)))
    assert watcher.poll() == []
    mount.write(go_marshal(document([], retry_time=6)))
    assert watcher.poll() == [RestartAll(6)]


def test_graceful_exit_stops_everything_and_recovers_nothing(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(plugin_episode([2], "unrecovered", retry_time=1))
    assert watcher.poll() == [DeviceFaulty(2, UCE, "reset")]
    mount.write(go_marshal(document([], retry_time=1, graceful_exit=1)))
    assert watcher.poll() == [GracefulExit(())]
    assert watcher.faulty_ranks == (2,)
    mount.write(go_marshal(document([], retry_time=1, graceful_exit=1, update_time=1764680111)))
    assert watcher.poll() == []                        # still set: no repeat
    mount.write(go_marshal(document([], retry_time=1, graceful_exit=0)))
    assert watcher.poll() == [DeviceRecovered(2)]      # Volcano reset it, the list is cleared
    mount.write(go_marshal(document([plugin_entry(0, "unrecovered", "reset")], retry_time=2, graceful_exit=1)))
    assert watcher.poll() == [DeviceFaulty(0, UCE, "reset"), GracefulExit((0,))]


def test_graceful_exit_present_at_the_first_read_is_reported(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([plugin_entry(1, "unrecovered", "reset")], retry_time=1, graceful_exit=1)))
    assert watcher.poll() == [DeviceFaulty(1, UCE, "reset"), GracefulExit((1,))]


def test_legacy_plugin_files(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(legacy([plugin_entry(4, "unrecovered", "reset")]))
    assert watcher.poll() == [DeviceFaulty(4, UCE, "reset")]
    mount.write(legacy([plugin_entry(4, "recovered", "reset")]))
    assert watcher.poll() == [DeviceRecovered(4)]
    mount.write(legacy([plugin_entry(5, "unrecovered", "reset")]))
    watcher.poll()
    mount.write(legacy(None))
    assert watcher.poll() == [DeviceRecovered(5)]


def test_restart_type_beside_the_file(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([], retry_time=1)))
    watcher.poll()
    assert watcher.restart_type is None                 # absent
    mount.write(go_marshal(document([], retry_time=1)), restart_type="podReschedule")
    watcher.poll()
    assert watcher.restart_type == "podReschedule"
    mount.write(go_marshal(document([], retry_time=2)))  # stale: written once, never removed
    assert watcher.poll() == [RestartAll(2)]
    assert watcher.restart_type == "podReschedule"
    assert read_reset_file(mount.path).restart_type == "podReschedule"


def test_every_event_type_is_exported_frozen_and_documented() -> None:
    assert set(DEVICE_EVENTS) == {DeviceFaulty, DeviceRecovered, DeviceFailed, ProcessFault, RestartAll,
                                  FaultFlushing, GracefulExit}
    for event_type in DEVICE_EVENTS:
        assert "must" in (event_type.__doc__ or "")
        assert event_type.__dataclass_params__.frozen  # type: ignore[attr-defined]


# ---- the two mount layouts ------------------------------------------------------------------------

def test_kubelet_configmap_volume(tmp_path: Path) -> None:
    volume = KubeletMount(tmp_path / "config")
    volume.publish(INITIAL)
    watcher = ResetWatcher(volume.path, 0.01)
    assert watcher.poll() == []
    volume.publish(plugin_episode([1], "unrecovered", retry_time=1))
    assert watcher.poll() == [DeviceFaulty(1, UCE, "reset")]
    assert watcher.restart_type == "hotReset"
    volume.publish(plugin_episode([1], "recovered", retry_time=1))
    assert watcher.poll() == [DeviceRecovered(1)]
    assert [p.name for p in volume.directory.iterdir() if p.name.startswith("..2")].__len__() == 1


def test_check_code_mismatch_is_a_bad_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    volume = KubeletMount(tmp_path / "config")
    volume.publish(plugin_episode([1], "unrecovered", retry_time=1))
    watcher = ResetWatcher(volume.path, 0.01)
    assert watcher.poll() == [DeviceFaulty(1, UCE, "reset")]
    caplog.set_level(logging.WARNING, logger="mindft.resetwatch")
    volume.publish(plugin_episode([1], "recovered", retry_time=1), code=check_code(b"something else"))
    assert watcher.poll() == [] and watcher.poll() == []
    assert watcher.faulty_ranks == (1,)
    assert watcher.last_error is not None and watcher.last_error.startswith("checkCode mismatch")
    assert sum("checkCode" in r.getMessage() for r in caplog.records) == 1
    volume.publish(plugin_episode([1], "recovered", retry_time=1))
    assert watcher.poll() == [DeviceRecovered(1)]
    assert watcher.last_error is None


def test_kubelet_swaps_under_a_polling_thread(tmp_path: Path) -> None:
    volume = KubeletMount(tmp_path / "config")
    volume.publish(go_marshal(document([], retry_time=0)))
    watcher = ResetWatcher(volume.path, 0.001)
    seen: list[object] = []
    watcher.start(seen.append)

    def wait_until_seen(event: object) -> None:
        deadline = time.monotonic() + 10
        while event not in seen and time.monotonic() < deadline:
            time.sleep(0.005)

    try:
        for episode in range(1, 41):
            volume.publish(plugin_episode([episode % 4], "unrecovered", retry_time=episode))
            if episode == 1:  # one swap is certainly read mid-stream, however loaded the machine
                wait_until_seen(DeviceFaulty(1, UCE, "reset"))
            volume.publish(plugin_episode([episode % 4], "recovered", retry_time=episode))
        volume.publish(plugin_episode([9], "unrecovered", retry_time=99))
        wait_until_seen(DeviceFaulty(9, UCE, "reset"))
        assert watcher.alive
    finally:
        watcher.stop()
    assert seen[-1] == DeviceFaulty(9, UCE, "reset")
    # Each rank alternates strictly faulty → recovered (a poll may miss a short-lived state, and a
    # rank overwritten before its "recovered" was seen stays faulty); a swap never reads as anything else.
    for rank in range(4):
        mine = [type(e).__name__ for e in seen if getattr(e, "rank", None) == rank]
        assert mine == [("DeviceFaulty", "DeviceRecovered")[i % 2] for i in range(len(mine))]
    assert len(seen) > 1  # the swaps were read, not only the last state


def test_host_path_empty_read_is_never_no_faults(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(plugin_episode([0, 1], "unrecovered", retry_time=1))
    assert len(watcher.poll()) == 2
    mount.write(b"")                                    # truncated, not yet written
    assert watcher.poll() == []
    assert watcher.faulty_ranks == (0, 1) and watcher.last_error is not None
    mount.write(plugin_episode([0, 1], "unrecovered", retry_time=1)[:25])  # partly written
    assert watcher.poll() == [] and watcher.faulty_ranks == (0, 1)
    mount.write(plugin_episode([0, 1], "unrecovered", retry_time=1))
    assert watcher.poll() == [] and watcher.last_error is None


def test_a_torn_read_is_retried_within_the_poll(mount: HostPathMount, watcher: ResetWatcher,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Generous retry delays so that the test does not depend on the machine's speed.
    monkeypatch.setattr(resetwatch, "QUICK_RETRY_DELAY", 0.1)
    mount.write(plugin_episode([0], "unrecovered", retry_time=1))
    assert len(watcher.poll()) == 1
    mount.write(b"")
    writer = threading.Timer(0.02, mount.write, args=(plugin_episode([0], "recovered", retry_time=1),))
    writer.start()
    try:
        assert watcher.poll() == [DeviceRecovered(0)]
    finally:
        writer.join()


def test_truncate_then_write_in_a_loop_never_reads_as_recovered(mount: HostPathMount) -> None:
    """Two nodes' episodes rewritten in place, in pieces, while the watcher thread polls."""
    node_a = plugin_episode(_ring(0, 4), "unrecovered", retry_time=1)
    node_b = plugin_episode(_ring(4, 4), "unrecovered", retry_time=2)
    mount.write(node_a)
    watcher = ResetWatcher(mount.path, 0.0005)
    seen: list[object] = []
    watcher.start(seen.append)
    deadline = time.monotonic() + 5  # node A's episode is read before node B's starts, as on a cluster
    while len(seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            for data in (node_a, node_b):
                mount.write_in_pieces(data, pieces=3, pause=0.0002)
                mount.write(data)
                time.sleep(0.003)  # the plugin keeps each state for 30 s; here a few polls

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(1.5)
    finally:
        stop.set()
        thread.join()
        mount.write(node_b)
        deadline = time.monotonic() + 5
        while watcher.faulty_ranks != tuple(range(8)) and time.monotonic() < deadline:
            time.sleep(0.01)
        watcher.stop()
    assert not any(isinstance(event, DeviceRecovered) for event in seen), seen
    assert sorted(event.rank for event in seen) == list(range(8))  # each fault reported once
    assert all(isinstance(event, DeviceFaulty) for event in seen)
    assert watcher.bad_reads > 0                                    # torn reads did happen


# ---- the watcher's own health ---------------------------------------------------------------------

def test_bad_reads_keep_state_and_log_once_per_kind(mount: HostPathMount, watcher: ResetWatcher,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    mount.write(plugin_episode([1], "unrecovered", retry_time=1))
    assert len(watcher.poll()) == 1
    caplog.set_level(logging.DEBUG, logger="mindft.resetwatch")
    for index in range(20):                            # twenty different broken files, one kind
        mount.write(b'{"RankList":[{"RankId":1,"Status":"recov' + b"x" * index)
        assert watcher.poll() == []
    for _ in range(5):
        mount.write(b"[" * 50_000)
        assert watcher.poll() == []
    mount.path.unlink()
    assert watcher.poll() == [] and watcher.poll() == []
    assert watcher.faulty_ranks == (1,)
    assert watcher.last_error is None                  # a missing file is not an error
    messages = [r.getMessage() for r in caplog.records if "reading again" in r.getMessage()]
    assert len(messages) == 3, messages                # invalid JSON, too deep, not present
    mount.write(plugin_episode([1], "recovered", retry_time=1))
    assert watcher.poll() == [DeviceRecovered(1)]


@pytest.mark.parametrize("make", [
    lambda path: path.mkdir(),
    lambda path: path.symlink_to(path.parent / "nowhere"),
    lambda path: __import__("os").mkfifo(path),
])
def test_odd_things_at_the_path_never_raise_or_block(tmp_path: Path, make: Any) -> None:
    path = tmp_path / "reset.json"
    make(path)
    watcher = ResetWatcher(path, 0.01)
    assert watcher.poll() == []
    assert watcher.last_error is not None


def test_an_unexpected_error_is_caught_logged_once_and_survived(mount: HostPathMount, watcher: ResetWatcher,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("a bug in the diff")

    original = resetwatch._diff_states
    monkeypatch.setattr(resetwatch, "_diff_states", broken)
    caplog.set_level(logging.ERROR, logger="mindft.resetwatch")
    for rank in range(3):
        mount.write(plugin_episode([rank], "unrecovered", retry_time=1))
        assert watcher.poll() == []
    assert len(caplog.records) == 1 and "bug in the diff" in (watcher.last_error or "")
    monkeypatch.setattr(resetwatch, "_diff_states", original)
    mount.write(plugin_episode([7], "unrecovered", retry_time=2))
    assert watcher.poll() == [DeviceFaulty(7, UCE, "reset")]


def test_thread_survives_a_bad_handler_and_reports_health(mount: HostPathMount) -> None:
    watcher = ResetWatcher(mount.path, poll_interval=0.01)
    assert not watcher.alive
    seen: list[object] = []
    got_two = threading.Event()

    def handler(event: object) -> None:
        seen.append(event)
        if len(seen) == 1:
            raise RuntimeError("handler bug")  # must not kill the watcher thread
        got_two.set()

    watcher.start(handler)
    try:
        assert watcher.alive
        mount.write(plugin_episode([0], "unrecovered", retry_time=1))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        mount.write(b"{half")
        mount.write(plugin_episode([0], "recovered", retry_time=1))
        assert got_two.wait(5.0)
        polls = watcher.poll_count
        deadline = time.monotonic() + 5
        while watcher.poll_count == polls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.poll_count > polls and watcher.last_poll is not None
    finally:
        watcher.stop()
    assert not watcher.alive
    assert seen == [DeviceFaulty(0, UCE, "reset"), DeviceRecovered(0)]


def test_a_dead_thread_is_visible_and_can_be_started_again(mount: HostPathMount) -> None:
    watcher = ResetWatcher(mount.path, poll_interval=0.01)

    def fatal(event: object) -> None:
        raise SystemExit("a handler that exits")

    mount.write(plugin_episode([0], "unrecovered", retry_time=1))
    watcher.start(fatal)
    deadline = time.monotonic() + 5
    while watcher.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not watcher.alive and "SystemExit" in (watcher.death or "")
    seen: list[object] = []
    watcher.start(seen.append)
    try:
        mount.write(plugin_episode([0], "recovered", retry_time=1))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watcher.stop()
    assert seen == [DeviceRecovered(0)] and watcher.death is None


def test_events_iterator(mount: HostPathMount) -> None:
    watcher = ResetWatcher(mount.path, 0.01)
    mount.write(plugin_episode([3], "unrecovered", retry_time=1))
    stop = threading.Event()
    iterator = watcher.events(stop)
    assert next(iterator) == DeviceFaulty(3, UCE, "reset")
    stop.set()
    assert list(iterator) == []


def test_rejects_non_positive_interval(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ResetWatcher(tmp_path / "reset.json", 0)


# ---- the library's writer -------------------------------------------------------------------------

def test_write_reset_file_host_path_is_the_plugins_format(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "reset.json"
    state = fault_state([2, 1], policy="reset", retry_time=1)
    write_reset_file(path, state, restart_type="hotReset")
    assert sorted(p.name for p in path.parent.iterdir()) == ["reset.json", "restartType"]
    document_written = json.loads(path.read_bytes())
    assert list(document_written) == ["RankList", "UpdateTime", "RetryTime", "FaultFlushing", "GracefulExit",
                                       "RestartFaultProcess"]
    assert list(document_written["RankList"][0]) == ["RankId", "LogicId", "Status", "Policy", "InitialPolicy",
                                                     "ErrorCode", "ErrorCodeHex"]
    assert document_written["RankList"][0]["ErrorCode"] == [] and \
        document_written["RankList"][0]["ErrorCodeHex"] == "80E01801"
    assert b" " not in path.read_bytes()
    again = read_reset_file(path)
    assert again.ranks == state.ranks and again.restart_type == "hotReset"


def test_write_reset_file_into_a_kubelet_volume(tmp_path: Path) -> None:
    volume = KubeletMount(tmp_path / "config")
    first = volume.publish(INITIAL, restart_type="podReschedule")
    write_reset_file(volume.path, fault_state([0], retry_time=1))
    assert not first.exists()                            # the old version is gone, swapped atomically
    data = volume.path.read_bytes()
    assert (volume.directory / "checkCode").read_text() == check_code(data)
    assert (volume.directory / "restartType").read_text() == "podReschedule"
    assert volume.path.is_symlink() and read_reset_file(volume.path).rank(0) is not None
