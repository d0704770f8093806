"""What MindIO TFT costs on the tiny job of tests/integration/mindio_rank.py (the real wheel, on CPU).

* per step: the ``begin_update`` + ``end_update`` pair (``tft_start_updating_os`` /
  ``tft_end_updating_os`` plus mindft's flag checks), in µs, over a long fault-free run;
* recovery: a UCE reported on the last rank → every rank resumed (the faulty rank's ``fault``
  event to the last ``resumed`` event), in seconds, for 2 and 4 ranks.

    python bench/mindio.py            # 3 recoveries per size, 2000 steps for the per-step cost
    python bench/mindio.py --quick    # 1 recovery per size, 300 steps
Writes bench/results/mindio.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "integration"
sys.path.insert(0, str(HELPERS))
import mindio_rank  # noqa: E402  (the job definition shared with the tests)

RUN_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(world_size: int, steps: int, fault: Optional[str], workdir: Path) -> Dict[int, List[dict]]:
    """One controller + ``world_size`` ranks; the events each rank printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS)]),
           "TTP_LOG_LEVEL": os.environ.get("TTP_LOG_LEVEL", "ERROR")}
    port = free_port()
    hub, close_hub = mindio_rank.serve_hub(world_size)
    script = str(HELPERS / "mindio_rank.py")
    controller = subprocess.Popen([sys.executable, script, "controller", str(world_size), str(port)],
                                  stdin=subprocess.PIPE, stdout=open(workdir / "controller.out", "w"),
                                  stderr=subprocess.STDOUT, env=env)
    ranks: List[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while "ready\n" not in (workdir / "controller.out").read_text():
            if controller.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"MindIO controller did not start; see {workdir / 'controller.out'}")
            time.sleep(0.05)
        for rank in range(world_size):
            command = [sys.executable, script, "rank", str(rank), str(world_size), str(port), hub,
                       str(steps), str(workdir / f"rank{rank}.npz")]
            if fault and rank == world_size - 1:
                command += ["--fault", fault]
            ranks.append(subprocess.Popen(command, stdout=open(workdir / f"rank{rank}.out", "w"),
                                          stderr=subprocess.DEVNULL, env=env))
        for rank, process in enumerate(ranks):
            code = process.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"rank {rank} exited with {code}; see {workdir}")
        controller.stdin.close()
        controller.wait(30)
    finally:
        for process in [*ranks, controller]:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        close_hub()
    events = {}
    for rank in range(world_size):
        lines = (workdir / f"rank{rank}.out").read_text().splitlines()
        events[rank] = [json.loads(line) for line in lines if line.startswith("{")]
    return events


def step_cost(steps: int) -> Dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        events = run_job(2, steps, None, Path(tmp))
    samples = [ns / 1000 for rank_events in events.values() for event in rank_events
               if event["event"] == "done" for ns in event["hook_ns"][10:]]  # skip the warm-up steps
    ordered = sorted(samples)
    return {"steps": len(samples), "median_us": statistics.median(samples),
            "mean_us": statistics.fmean(samples), "p99_us": ordered[int(0.99 * (len(ordered) - 1))]}


def recovery_seconds(world_size: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        events = run_job(world_size, 12, "uce:5", Path(tmp))
    fault = next(e["t"] for e in events[world_size - 1] if e["event"] == "fault")
    resumed = max(e["t"] for rank_events in events.values() for e in rank_events if e["event"] == "resumed")
    return resumed - fault


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and one recovery per size")
    args = parser.parse_args()
    rounds, steps = (1, 300) if args.quick else (3, 2000)
    cost = step_cost(steps)
    print(f"per step, begin_update + end_update: median {cost['median_us']:.1f} µs, "
          f"mean {cost['mean_us']:.1f} µs, p99 {cost['p99_us']:.1f} µs ({cost['steps']} samples)")
    recoveries = {}
    for world_size in (2, 4):
        times = [recovery_seconds(world_size) for _ in range(rounds)]
        recoveries[world_size] = {"seconds": times, "median": statistics.median(times)}
        print(f"recovery, UCE on 1 of {world_size} ranks → all resumed: median "
              f"{statistics.median(times):.2f} s  ({', '.join(f'{t:.2f}' for t in times)})")
    results = {"benchmark": "mindio", "wheel": "mindio_ttp 7.3.0", "python": platform.python_version(),
               "cpus": os.cpu_count(), "step_cost": cost, "recovery": recoveries}
    out = ROOT / "bench" / "results" / "mindio.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
