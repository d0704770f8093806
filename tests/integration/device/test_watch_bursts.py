"""The reset file's watcher thread under bursts of broken files written to a real file: it stays
alive, warns once per kind of problem, and still turns a valid ``unrecovered`` then
``recovered`` into the right events after every burst (the parser alone:
tests/unit/device/test_watch_fuzz.py)."""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import pytest
from plugin_files import HostPathMount, plugin_episode
from reset_garbage import SEED, garbage

from mindft.device.watch import ResetWatcher
from mindft.flow.inputs import DeviceFaulty, DeviceRecovered

pytestmark = pytest.mark.slow  # seconds of a polling thread under bursts


def _wait_for(seen: list[object], event: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if event in seen:
            return True
        time.sleep(0.002)
    return False


def test_watcher_thread_survives_bursts_of_garbage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(SEED + 1)
    mount = HostPathMount(tmp_path / "default.reset-config-job")
    watcher = ResetWatcher(mount.path, poll_interval=0.001)
    seen: list[object] = []
    caplog.set_level(logging.WARNING, logger="mindft.device.watch")
    watcher.start(seen.append)
    try:
        for burst in range(20):
            warnings_before = len(caplog.records)
            for _ in range(100):
                mount.write(garbage(rng))
                time.sleep(0.0005)
            polls = watcher.poll_count
            while watcher.poll_count < polls + 2 and watcher.alive:
                time.sleep(0.001)
            assert watcher.alive, watcher.death
            check_rank = 1000 + burst
            start = len(seen)
            mount.write(plugin_episode([check_rank], "unrecovered", retry_time=100 + burst))
            assert _wait_for(seen, DeviceFaulty(check_rank, "0x80E01801", "reset")), (burst, watcher.last_error)
            mount.write(plugin_episode([check_rank], "recovered", retry_time=100 + burst))
            assert _wait_for(seen, DeviceRecovered(check_rank)), (burst, watcher.last_error)
            mine = [event for event in seen[start:] if getattr(event, "rank", None) == check_rank]
            assert mine == [DeviceFaulty(check_rank, "0x80E01801", "reset"), DeviceRecovered(check_rank)]
            assert watcher.last_error is None
            # Not once per file or per poll: once per kind of problem until a good read (and the
            # garbage holds valid files too, each of which ends a bad streak).
            warnings = len(caplog.records) - warnings_before
            assert warnings <= 50, warnings
        assert watcher.bad_reads > 100
    finally:
        watcher.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
