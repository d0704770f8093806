"""A seeded generator of reset files: the device plugin's and clusterd's valid files, and broken ones
of every kind a reader may meet (depth, long numbers, wrong types, encodings, truncation, noise,
flipped bytes, oversized files, JSON's odd constants). Shared by the parser's fuzz test
(tests/unit/device/test_watch_fuzz.py) and the watcher thread's (tests/integration/device/)."""
from __future__ import annotations

import json
import random
from typing import Any, Callable

from plugin_files import INITIAL, clusterd_entry, document, go_marshal, legacy, plugin_entry

from mindft.device.resetfile import MAX_FILE_BYTES

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


def garbage(rng: random.Random) -> bytes:
    """One input, valid or broken in one of the ways above, drawn from ``rng``."""
    mutations, weights = zip(*MUTATIONS)
    return rng.choices(mutations, weights)[0](rng)
