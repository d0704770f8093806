"""Benchmark mindft.snapshot.store against plain numpy copies of the same bytes.

For 25M and 100M float32 parameters with Adam state (parameters + two moments =
3x the parameter bytes), measured side by side in one run:

* capture throughput (capture + wait: copy and checksum) vs ``numpy.copyto``;
* restore throughput (verify + copy into the model) vs ``numpy.copyto``;
* the checksum candidates on their own (zlib.crc32, xxh3_64, xxh64);
* how long a simulated training step is blocked per capture at one capture per step.

Run: ``python bench/snapshot.py``; prints a table and writes bench/results/snapshot.json
(``--quick``: 1M parameters only, every measurement once; the suite's smoke run).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mindft.snapshot import store as snapshot
from mindft.net.keys import generate_keys
from mindft.replica import Keeper, RankReplication, fetch_replica, push_replica
from mindft.snapshot.store import SnapshotStore

try:
    import xxhash
except ImportError:
    xxhash = None

REPEATS = 7
REPLICA_MAX_PARAMS = 25_000_000  # the replica copies the state twice more: keep memory < 8 GB
LAYERS = 24
STEPS = 8  # simulated training steps per pattern
RESULTS = Path(__file__).resolve().parent / "results" / "snapshot.json"


def adam_state(params: int) -> dict:
    """``params`` float32 parameters in LAYERS weight matrices + biases, each with two Adam moments."""
    arrays = {}
    bias = 1024
    weight = params // LAYERS - bias
    for layer in range(LAYERS):
        for name, size in (("weight", weight), ("bias", bias)):
            for kind in ("param", "adam.m", "adam.v"):
                # Not zeros: calloc'ed zero pages would make every copy look free.
                arrays[f"{kind}.layer{layer}.{name}"] = np.full(size, 0.5 + layer, np.float32)
    return arrays


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def side_by_side(cases: dict, repeats: int = REPEATS) -> dict:
    """Median seconds per case, the cases interleaved so drift hits them all alike."""
    samples = {name: [] for name in cases}
    for _ in range(repeats):
        for name, function in cases.items():
            samples[name].append(timed(function))
    return {name: statistics.median(values) for name, values in samples.items()}


def copy_all(dst: dict, src: dict) -> None:
    for name, array in src.items():
        np.copyto(dst[name], array)


def copy_all_2threads(pool: ThreadPoolExecutor, dst: dict, src: dict) -> None:
    """Split every array in halves over two threads (numpy releases the GIL in copyto)."""
    futures = []
    for name, array in src.items():
        half = array.size // 2
        futures.append(pool.submit(np.copyto, dst[name][:half], array[:half]))
        futures.append(pool.submit(np.copyto, dst[name][half:], array[half:]))
    for future in futures:
        future.result()


def hash_all(arrays: dict, hasher) -> None:
    for array in arrays.values():
        hasher(memoryview(array).cast("B"))


def simulated_step(seconds: float, scratch: np.ndarray) -> None:
    """Forward/backward stand-in: compute-bound, cache-resident, releases the GIL like a kernel would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.exp(scratch, out=scratch)
        np.log1p(scratch, out=scratch)


def blocked_per_capture(store: SnapshotStore, arrays: dict, step_seconds: float, overlap: bool) -> dict:
    """Run STEPS steps capturing once per step; time the training thread spends inside the store.

    overlap=True: capture at the end of step s, wait() only before step s+1's optimizer
    update (the parameters must not change while they are copied) — the copy runs
    under forward/backward. overlap=False: capture and wait back to back.
    """
    scratch = np.random.default_rng(0).random(16_384)
    blocked, start = [], time.perf_counter()
    store.capture(0, arrays)
    store.wait()
    for step in range(1, STEPS + 1):
        simulated_step(step_seconds, scratch)  # forward/backward: parameters untouched
        spent = timed(store.wait) if overlap else 0.0
        # (the optimizer update would mutate the parameters here)
        spent += timed(lambda: store.capture(step, arrays))
        if not overlap:
            spent += timed(store.wait)
        blocked.append(spent)
    store.wait()
    elapsed = time.perf_counter() - start
    return {"blocked_ms_median": 1e3 * statistics.median(blocked), "blocked_ms_max": 1e3 * max(blocked),
            "step_overhead_pct": 100 * statistics.mean(blocked) / step_seconds, "wall_s": elapsed}


def replica_throughput(store: SnapshotStore, total: int) -> dict:
    """Push to and fetch+verify from a CurveZMQ replica keeper on 127.0.0.1 (both ends on this machine):
    ``push`` in one request, ``stream`` as a rank streams it (zero-copy parts from the store's slot,
    begin to the keeper's confirmation)."""
    with tempfile.TemporaryDirectory() as directory:
        keys = generate_keys(Path(directory) / "job.key")
    keeper = Keeper(None, "127.0.0.1", keys)
    latest = store.restore()
    replication = RankReplication(0, store, keys, lambda: keeper.endpoint, None, lambda: None,
                                  lost_after=600.0, ack_timeout=600.0)
    while replication.sender.replicated[0] != latest.step:  # it streams the newest snapshot at once
        time.sleep(0.001)

    def stream() -> None:
        replication.restored(latest.step)  # a new epoch: the same snapshot is streamed again
        while replication.unconfirmed:
            time.sleep(0.0005)

    try:
        seconds = side_by_side({
            "push": lambda: push_replica(keeper.endpoint, 0, latest, keys, 600),
            "stream": stream,
            "fetch_verify": lambda: fetch_replica(keeper.endpoint, 0, keys, 600),
        }, repeats=3)
    finally:
        replication.close()
        keeper.close()
    return {name: total / value / 1e9 for name, value in seconds.items()}


def run(params: int) -> dict:
    arrays = adam_state(params)
    total = sum(array.nbytes for array in arrays.values())
    reference = {name: np.full_like(array, 1.5) for name, array in arrays.items()}  # copyto's target
    store = SnapshotStore()
    for step in (1, 2):  # first captures allocate and fault in both slots; measure the steady state
        store.capture(step, arrays)
        store.wait()
    step = [2]

    def capture() -> None:
        step[0] += 1
        store.capture(step[0], arrays)
        store.wait()

    def capture_crc32() -> None:
        saved, snapshot.CHECKSUM = snapshot.CHECKSUM, "crc32"
        try:
            capture()
        finally:
            snapshot.CHECKSUM = saved

    pool = ThreadPoolExecutor(2)
    cases = {
        "copyto": lambda: copy_all(reference, arrays),
        "copyto_2threads": lambda: copy_all_2threads(pool, reference, arrays),
        "capture": capture,
        "restore_into": lambda: store.restore(into=arrays),  # verify while copying into the "model"
        "restore_then_copyto": lambda: copy_all(arrays, store.restore().arrays),
        "crc32": lambda: hash_all(arrays, zlib.crc32),
    }
    if xxhash is not None:
        cases["xxh3_64"] = lambda: hash_all(arrays, xxhash.xxh3_64_intdigest)
        cases["xxh64"] = lambda: hash_all(arrays, xxhash.xxh64_intdigest)
        cases["capture_crc32"] = capture_crc32
    seconds = side_by_side(cases)
    pool.shutdown()
    throughput = {name: total / value / 1e9 for name, value in seconds.items()}
    copy_seconds = seconds["copyto"]
    # A step about twice as long as one capture: the regime where overlapping should hide it.
    step_seconds = round(max(0.05, 2 * seconds["capture"]), 3)
    result = {
        "params": params,
        "state_bytes": total,
        "arrays": len(arrays),
        "store_nbytes": store.nbytes,
        "gb_per_s": throughput,
        "capture_vs_copyto": copy_seconds / seconds["capture"],
        "restore_into_vs_copyto": copy_seconds / seconds["restore_into"],
        "restore_then_copyto_vs_copyto": copy_seconds / seconds["restore_then_copyto"],
        "copyto_2threads_vs_copyto": copy_seconds / seconds["copyto_2threads"],
        "simulated_step_s": step_seconds,
        "overlapped": blocked_per_capture(store, arrays, step_seconds, overlap=True),
        "synchronous": blocked_per_capture(store, arrays, step_seconds, overlap=False),
    }
    if "capture_crc32" in seconds:
        result["capture_crc32_vs_copyto"] = copy_seconds / seconds["capture_crc32"]
    if params <= REPLICA_MAX_PARAMS:
        del reference
        result["replica_curve_gb_per_s"] = replica_throughput(store, total)
    store.close()
    return result


def main() -> None:
    global REPEATS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M parameters, each measurement once")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        REPEATS = 1
    started = time.perf_counter()
    results = []
    for params in (1_000_000,) if args.quick else (25_000_000, 100_000_000):
        results.append(run(params))
        gc.collect()
    report = {
        "checksum": snapshot.CHECKSUM,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "repeats": REPEATS,
        "results": results,
        "runtime_s": time.perf_counter() - started,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))

    print(f"mindft snapshot benchmark: checksum {report['checksum']}, {report['cpus']} CPUs, "
          f"median of {REPEATS}, GB/s = 1e9 bytes/s")
    header = f"{'':34}" + "".join(f"{r['params'] // 1_000_000:>10}M params" for r in results)
    print(header)
    rows = [
        ("state bytes (params + Adam m, v)", lambda r: f"{r['state_bytes'] / 1e9:.2f} GB"),
        ("store.nbytes (two slots)", lambda r: f"{r['store_nbytes'] / 1e9:.2f} GB"),
        ("numpy.copyto GB/s", lambda r: f"{r['gb_per_s']['copyto']:.2f}"),
        ("numpy.copyto, 2 threads GB/s", lambda r: f"{r['gb_per_s']['copyto_2threads']:.2f}"),
        ("capture+wait GB/s", lambda r: f"{r['gb_per_s']['capture']:.2f}"),
        ("  ratio vs copyto", lambda r: f"{r['capture_vs_copyto']:.2f}"),
        ("capture+wait with crc32, ratio", lambda r: f"{r.get('capture_crc32_vs_copyto', float('nan')):.2f}"),
        ("restore(into=model) GB/s", lambda r: f"{r['gb_per_s']['restore_into']:.2f}"),
        ("  ratio vs copyto", lambda r: f"{r['restore_into_vs_copyto']:.2f}"),
        ("restore() then copyto, ratio", lambda r: f"{r['restore_then_copyto_vs_copyto']:.2f}"),
        ("zlib.crc32 GB/s", lambda r: f"{r['gb_per_s']['crc32']:.2f}"),
        ("xxh3_64 GB/s", lambda r: f"{r['gb_per_s'].get('xxh3_64', float('nan')):.2f}"),
        ("xxh64 GB/s", lambda r: f"{r['gb_per_s'].get('xxh64', float('nan')):.2f}"),
        ("replica push (curve) GB/s", lambda r: replica(r, "push")),
        ("replica streamed (curve) GB/s", lambda r: replica(r, "stream")),
        ("replica fetch+verify GB/s", lambda r: replica(r, "fetch_verify")),
        ("simulated step", lambda r: f"{1e3 * r['simulated_step_s']:.0f} ms"),
        ("blocked/capture, overlapped", lambda r: f"{r['overlapped']['blocked_ms_median']:.1f} ms"),
        ("  step overhead", lambda r: f"{r['overlapped']['step_overhead_pct']:.1f} %"),
        ("blocked/capture, synchronous", lambda r: f"{r['synchronous']['blocked_ms_median']:.1f} ms"),
        ("  step overhead", lambda r: f"{r['synchronous']['step_overhead_pct']:.1f} %"),
    ]
    def replica(r: dict, name: str) -> str:
        return f"{r['replica_curve_gb_per_s'][name]:.2f}" if "replica_curve_gb_per_s" in r else "-"

    for label, cell in rows:
        print(f"{label:34}" + "".join(f"{cell(r):>17}" for r in results))
    print(f"runtime {report['runtime_s']:.0f} s; wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
