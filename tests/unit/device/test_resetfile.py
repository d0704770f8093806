"""The reset file as Huawei's writers produce it: parsing every field and every bad read, writing it back."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from plugin_files import (INITIAL, KubeletMount, check_code, clusterd_entry, document, go_marshal, legacy,
                          plugin_entry, plugin_episode)

from mindft.device.simulator import fault_state
from mindft.device.resetfile import (ResetFileError, ResetRank, ResetState, parse_reset, read_reset_file, render_reset,
                              write_reset_file)

UCE = "0x80E01801"


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
        ResetRank(e.rank, e.status, e.policy, e.initial_policy, e.error_codes, e.error_code_hex,
                  logic_id=e.rank % 8) for e in state.ranks), retry_time=3, update_time=1764680000)
    expected = plugin_episode([0, 1], "unrecovered", "reset", retry_time=3, initial_policy="restart_request")
    assert render_reset(state).encode() == expected
    assert parse_reset(expected).ranks == state.ranks


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
