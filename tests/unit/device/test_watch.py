"""The reset file's meaning over time: episodes, clusterd and Volcano, both mount layouts, the watcher's health."""
from __future__ import annotations

import logging
import threading
import time
import typing
from pathlib import Path
from typing import Any, Optional

import pytest
from plugin_files import (INITIAL, HostPathMount, KubeletMount, check_code, clusterd_entry, document, go_marshal,
                          legacy, plugin_entry, plugin_episode)

import mindft.device.watch as resetwatch
from mindft.flow.watcher import WatcherSupervision
from mindft.flow.inputs import (DEVICE_INPUTS, DeviceFailed, DeviceFaulty, DeviceInput, DeviceRecovered, HoldRepairs,
                                RollbackAll, StopJob)
from mindft.device.resetfile import read_reset_file
from mindft.device.watch import ResetWatcher

UCE = "0x80E01801"


@pytest.fixture
def mount(tmp_path: Path) -> HostPathMount:
    return HostPathMount(tmp_path / "default.reset-config-job")


@pytest.fixture
def watcher(mount: HostPathMount) -> ResetWatcher:
    return ResetWatcher(mount.path, poll_interval=0.01)


def _ring(first: int, count: int = 8) -> list[int]:
    return list(range(first, first + count))


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
    assert watcher.poll() == [HoldRepairs(True)]
    assert watcher.fault_flushing
    mount.write(go_marshal(document([clusterd_entry(3), clusterd_entry(1)], retry_time=0,
                                    restart_fault_process=True)))
    assert watcher.poll() == [RollbackAll.process_fault(1, True), RollbackAll.process_fault(3, True),
                              HoldRepairs(False)]
    assert watcher.process_fault_ranks == (1, 3)
    mount.write(go_marshal(document([], retry_time=0, fault_flushing=True)))
    assert watcher.poll() == [HoldRepairs(True)]       # flushing again: the faults stay open
    assert watcher.process_fault_ranks == (1, 3)
    mount.write(go_marshal(document([], retry_time=1)), restart_type="hotReset")
    events = watcher.poll()
    assert events == [DeviceRecovered(1), DeviceRecovered(3), HoldRepairs(False), RollbackAll.restart_all(1)]
    assert {e.cause for e in events if isinstance(e, DeviceRecovered)} == {"restart_all"}
    assert events[-1].restart_type == "hotReset"
    assert watcher.process_fault_ranks == ()


def test_clusterd_fault_restarting_every_process(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([clusterd_entry(2)], retry_time=3, restart_fault_process=False)))
    assert watcher.poll() == [RollbackAll.process_fault(2, False, retry_time=3)]
    mount.write(go_marshal(document([], retry_time=4)))
    assert watcher.poll() == [DeviceRecovered(2), RollbackAll.restart_all(4)]


def test_restart_all_at_the_first_read_is_history(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([], retry_time=5)))
    assert watcher.poll() == []
    mount.write(go_marshal(document([], retry_time=6)))
    assert watcher.poll() == [RollbackAll.restart_all(6)]


def test_graceful_exit_stops_everything_and_recovers_nothing(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(plugin_episode([2], "unrecovered", retry_time=1))
    assert watcher.poll() == [DeviceFaulty(2, UCE, "reset")]
    mount.write(go_marshal(document([], retry_time=1, graceful_exit=1)))
    assert watcher.poll() == [StopJob.graceful_exit(())]
    assert watcher.faulty_ranks == (2,)
    mount.write(go_marshal(document([], retry_time=1, graceful_exit=1, update_time=1764680111)))
    assert watcher.poll() == []                        # still set: no repeat
    mount.write(go_marshal(document([], retry_time=1, graceful_exit=0)))
    assert watcher.poll() == [DeviceRecovered(2)]      # Volcano reset it, the list is cleared
    mount.write(go_marshal(document([plugin_entry(0, "unrecovered", "reset")], retry_time=2, graceful_exit=1)))
    assert watcher.poll() == [DeviceFaulty(0, UCE, "reset"), StopJob.graceful_exit((0,))]


def test_graceful_exit_present_at_the_first_read_is_reported(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([plugin_entry(1, "unrecovered", "reset")], retry_time=1, graceful_exit=1)))
    assert watcher.poll() == [DeviceFaulty(1, UCE, "reset"), StopJob.graceful_exit((1,))]


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
    assert watcher.poll() == [RollbackAll.restart_all(2)]
    assert watcher.restart_type == "podReschedule"
    assert read_reset_file(mount.path).restart_type == "podReschedule"


def test_every_input_type_is_frozen_and_says_what_to_do() -> None:
    assert set(DEVICE_INPUTS) == set(typing.get_args(DeviceInput))
    for event_type in DEVICE_INPUTS:
        assert "must" in (event_type.__doc__ or "")
        assert event_type.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_clusterd_and_volcano_events_carry_what_the_file_said(mount: HostPathMount, watcher: ResetWatcher) -> None:
    mount.write(go_marshal(document([clusterd_entry(2)], retry_time=3, restart_fault_process=True)))
    [fault] = watcher.poll()
    assert (fault.rank, fault.only_faulty, fault.retry_time) == (2, True, 3)
    assert fault.reason == "clusterd reported a fault of rank 2"
    mount.write(go_marshal(document([], retry_time=4, graceful_exit=1)))
    [stop] = watcher.poll()
    assert stop == StopJob("Volcano asked every training process to exit (GracefulExit)") and stop.retry_time == 4
    mount.write(go_marshal(document([], retry_time=5)), restart_type="hotReset")
    events = watcher.poll()
    assert events[-1] == RollbackAll("clusterd restarts every process (RetryTime 5)", -1, False, 5)
    assert events[-1].restart_type == "hotReset"


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
    caplog.set_level(logging.WARNING, logger="mindft.device.watch")
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
    caplog.set_level(logging.DEBUG, logger="mindft.device.watch")
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
    caplog.set_level(logging.ERROR, logger="mindft.device.watch")
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


def test_a_dead_watcher_thread_is_started_again_as_its_supervision_says(tmp_path: Path) -> None:
    volume = KubeletMount(tmp_path / "config")
    volume.publish(plugin_episode([1], "unrecovered", retry_time=1))
    watcher = ResetWatcher(volume.path, 0.001)
    seen: list[object] = []

    class Fatal(BaseException):
        """What no watcher survives (a consumer's Exception is logged and the thread goes on)."""

    def dies(event: object) -> None:
        raise Fatal("the thread's end")

    supervision = WatcherSupervision(delay=0.0, max_restarts=1)
    assert watcher.supervise(supervision, 0.0, seen.append) is None  # never started: nothing to restart
    try:
        watcher.start(dies)
        deadline = time.monotonic() + 10
        while watcher.alive and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not watcher.alive and "the thread's end" in watcher.death
        assert watcher.supervise(supervision, 1.0, seen.append) is None  # started again, with the new callback
        volume.publish(plugin_episode([1], "recovered", retry_time=1))
        while not seen and time.monotonic() < deadline:
            time.sleep(0.005)
        assert seen == [DeviceRecovered(1)] and watcher.alive
    finally:
        watcher.stop()
    watcher.start(dies)
    volume.publish(plugin_episode([2], "unrecovered", retry_time=2))
    while watcher.alive and time.monotonic() < deadline:
        time.sleep(0.005)
    reason = watcher.supervise(supervision, 2.0, seen.append)
    assert reason is not None and "died 2 times" in reason and str(volume.path) in reason
    watcher.stop()
    assert watcher.supervise(supervision, 4.0, seen.append) is None  # stopped on purpose: not a death
