"""A seeded fuzzer over the reset file's structure: depth, sizes, types, encodings, truncation, noise.

Each input either parses or is a :class:`ResetFileError`; nothing else escapes. The
real watcher thread reads bursts of such files from a real file and must still turn
a valid ``unrecovered`` then ``recovered`` into the right events after every burst.
"""
from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from plugin_files import (INITIAL, HostPathMount, clusterd_entry, document, go_marshal, legacy, plugin_entry,
                          plugin_episode)

from mindft.flow.inputs import DeviceFaulty, DeviceRecovered
from mindft.device.resetfile import MAX_FILE_BYTES, ResetFileError, ResetState, parse_reset
from mindft.device.watch import ResetWatcher, _diff_states

SEED = 20260611
GARBAGE_RANKS = range(16)        # ranks the garbage may name; the checks use ranks >= 1000
WRONG_TYPES: list[Any] = ["x", "1" * 30, [1], {"a": 1}, 1.5, True, -1, 1 << 70, ""]


def _base(rng: random.Random) -> dict[str, Any]:
    ranks = rng.sample(GARBAGE_RANKS, rng.randint(0, 4))
    kind = rng.randrange(4)
    if kind == 0:
        status = rng.choice(["unrecovered", "recovered", "failed"])
        return document([plugin_entry(r, status, rng.choice(["reset", "restart", "isolate"])) for r in ranks],
                        retry_time=rng.randint(0, 9))
    if kind == 1:
        return document([clusterd_entry(r) for r in ranks], retry_time=rng.randint(0, 9),
                        fault_flushing=rng.random() < 0.3, restart_fault_process=rng.random() < 0.5)
    if kind == 2:
        return json.loads(legacy([plugin_entry(r, "unrecovered", "reset") for r in ranks]))
    return document([], retry_time=rng.randint(0, 9), graceful_exit=rng.choice([0, 1]))


def _deep(rng: random.Random) -> bytes:
    depth = rng.choice([17, 40, 1000, 100_000, 200_000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}"), (b'{"RankList":[', b"]}")])
    body = opener * depth + b"1" + closer * depth
    return body if rng.random() < 0.7 else body[: rng.randrange(len(body))]


def _long_number(rng: random.Random) -> bytes:
    digits = rng.choice([21, 25, 4300, 4301, 5000, 20_000])
    number = ("-" if rng.random() < 0.3 else "") + "9" * digits
    where = rng.choice(["RankId", "RetryTime", "LogicId", "UpdateTime", "ErrorCode"])
    if where in ("RankId", "LogicId", "ErrorCode"):
        value = f"[{number}]" if where == "ErrorCode" else number
        return f'{{"RankList":[{{"{where}":{value},"Status":"unrecovered"}}],"RetryTime":1}}'.encode()
    return f'{{"RankList":[],"{where}":{number}}}'.encode()


def _wrong_type(rng: random.Random) -> bytes:
    doc = _base(rng)
    if isinstance(doc["RankList"], list) and doc["RankList"] and rng.random() < 0.5:
        entry = rng.choice(doc["RankList"])
        entry[rng.choice(list(entry))] = rng.choice(WRONG_TYPES + [None])
    else:
        key = rng.choice(["RankList", "RetryTime", "FaultFlushing", "GracefulExit", "RestartFaultProcess"])
        doc[key] = rng.choice(WRONG_TYPES)
    return go_marshal(doc)


def _encoding(rng: random.Random) -> bytes:
    text = go_marshal(_base(rng)).decode()
    choice = rng.randrange(6)
    if choice == 0:
        return text.encode(rng.choice(["utf-16", "utf-16-le", "utf-32"]))
    if choice == 1:
        return b"\xef\xbb\xbf" + text.encode()
    if choice == 2:
        data = bytearray(text.encode())
        data.insert(rng.randrange(len(data)), rng.choice([0xFF, 0xC0, 0x80, 0xED]))
        return bytes(data)
    if choice == 3:
        return text.replace('"Status":"', '"Status":"\\ud800').encode()
    if choice == 4:
        return text.replace('"RankList"', '"Rank\\u0000List"').encode()
    return ("\u00e9" * rng.randint(1, 50) + text).encode("latin-1", "replace")


def _truncated(rng: random.Random) -> bytes:
    data = go_marshal(_base(rng))
    return data[: rng.randrange(len(data))]


def _noise(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))


def _flipped(rng: random.Random) -> bytes:
    data = bytearray(go_marshal(_base(rng)))
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def _oversized(rng: random.Random) -> bytes:
    data = go_marshal(_base(rng))
    return data[:-1] + b"," + b'"pad":"' + b"x" * (MAX_FILE_BYTES + rng.randint(0, 100)) + b'"}'


def _constants(rng: random.Random) -> bytes:
    value = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-0", "1E+2", "0.0"])
    return f'{{"RankList":[],"RetryTime":{value}}}'.encode()


def _valid(rng: random.Random) -> bytes:
    return go_marshal(_base(rng)) if rng.random() < 0.9 else INITIAL


MUTATIONS: list[tuple[Callable[[random.Random], bytes], int]] = [
    (_deep, 6), (_long_number, 6), (_wrong_type, 14), (_encoding, 10), (_truncated, 14), (_noise, 12),
    (_flipped, 14), (_oversized, 1), (_constants, 5), (_valid, 8),
]


def _garbage(rng: random.Random) -> bytes:
    mutations, weights = zip(*MUTATIONS)
    return rng.choices(mutations, weights)[0](rng)


def test_parser_accepts_or_rejects_cleanly() -> None:
    """Every input parses or raises ResetFileError; the event diff never raises on what parses."""
    rng = random.Random(SEED)
    parsed = rejected = 0
    seen = None
    for _ in range(4000):
        data = _garbage(rng)
        try:
            state = parse_reset(data)
        except ResetFileError as error:
            assert error.kind and str(error)
            rejected += 1
            continue
        assert isinstance(state, ResetState)
        assert all(0 <= entry.rank < 1 << 31 for entry in state.ranks)
        seen, _ = _diff_states(seen, state)
        parsed += 1
    assert parsed > 300 and rejected > 2000   # both sides of the parser were exercised


def _wait_for(seen: list[object], event: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if event in seen:
            return True
        time.sleep(0.002)
    return False


@pytest.mark.slow  # seconds of a polling thread under bursts
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
                mount.write(_garbage(rng))
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
