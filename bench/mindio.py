"""mindft's two backends side by side on the same job, plus MindIO TFT's own costs (real wheel, CPU).

Part 1, both backends (``MINDFT_BACKEND=mindft`` and ``mindio``) on examples/train_mlp.py under
``mindft-launch --nproc 2`` with ``MS_ENABLE_TFT='{UCE:1}'``:

* recovery: a UCE in step 6 of rank 1 → every rank resumed (the launcher's first ``fault ... inside
  step`` line to its last ``resumed after step`` line, timestamped as they arrive), in seconds;
* per step: the wall time of a long run minus a short one, divided by the step difference, in ms
  (also for the example run without mindft, two plain processes; on a shared 2-core machine this
  difference is noisy to several ms).

Part 2, the wheel alone on tests/mindio_rank.py's numpy job: the ``begin_update`` +
``end_update`` pair in µs, and UCE recovery in seconds for 2 and 4 ranks.

    python bench/mindio.py            # 3 recoveries per backend/size, 200 extra steps
    python bench/mindio.py --quick    # 1 recovery, 100 extra steps
Writes bench/results/mindio.json and prints a table (copied into the README).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests"
sys.path.insert(0, str(HELPERS))
import mindio_rank  # noqa: E402  (the job definition shared with the tests)
from _common import free_port  # noqa: E402  (bench/ is the script's directory)

RUN_TIMEOUT = 180.0
EXAMPLE = ROOT / "examples" / "train_mlp.py"
SHORT_STEPS = 20


def run_job(world_size: int, steps: int, fault: Optional[str], workdir: Path) -> Dict[int, List[dict]]:
    """One controller + ``world_size`` ranks; the events each rank printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS)]),
           "TTP_LOG_LEVEL": os.environ.get("TTP_LOG_LEVEL", "ERROR")}
    port = free_port()
    script = str(HELPERS / "mindio_rank.py")
    processes: List[subprocess.Popen] = []  # the controller, then the ranks: all killed if still running

    def destroy_controller() -> None:  # once every rank finished, before their processors
        processes[0].stdin.close()
        processes[0].wait(30)

    hub, close_hub = mindio_rank.serve_hub(world_size, destroy_controller)
    try:
        controller = subprocess.Popen([sys.executable, script, "controller", str(world_size), str(port)],
                                      stdin=subprocess.PIPE, stdout=open(workdir / "controller.out", "w"),
                                      stderr=subprocess.STDOUT, env=env)
        processes.append(controller)
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
            processes.append(subprocess.Popen(command, stdout=open(workdir / f"rank{rank}.out", "w"),
                                              stderr=subprocess.DEVNULL, env=env))
        for rank, process in enumerate(processes[1:]):
            code = process.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"rank {rank} exited with {code}; see {workdir}")
        destroy_controller()
    finally:
        for process in processes:
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


def _example_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "MINDFT_", "RANK_", "TTP_"))}
    env.update(GLOG_v="3", PYTHONUNBUFFERED="1", TTP_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), **extra)
    return env


def launch_example(backend: str, steps: int, fault: bool, workdir: Path) -> Dict[str, float]:
    """One ``mindft-launch --nproc 2`` run; wall seconds and, with a fault, fault → resumed seconds."""
    env = _example_env(MINDFT_BACKEND=backend, MS_ENABLE_TFT="{UCE:1}")
    command = [sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--run-dir", str(workdir / "run"),
               str(EXAMPLE), "--steps", str(steps)]
    if fault:
        command += ["--fault-step", "6", "--fault-rank", "1"]
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    fault_at, resumed_at = None, None
    try:
        for line in process.stdout:
            now = time.monotonic()
            if fault_at is None and " inside step " in line and "fault" in line:
                fault_at = now
            if "resumed after step" in line:
                resumed_at = now
        code = process.wait(RUN_TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait(10)
    if code != 0:
        raise RuntimeError(f"mindft-launch ({backend}) exited with {code}")
    result = {"wall_s": time.monotonic() - started}
    if fault:
        if fault_at is None or resumed_at is None:
            raise RuntimeError(f"no fault/resumed lines from the {backend} run")
        result["recovery_s"] = resumed_at - fault_at
    return result


def plain_example(steps: int) -> float:
    """The example without mindft: two plain processes at once, wall seconds."""
    started = time.monotonic()
    processes = [subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", str(steps)],
                                  env=_example_env(MS_WORKER_NUM="2", MS_NODE_ID=str(rank)),
                                  stdout=subprocess.DEVNULL) for rank in range(2)]
    if any(p.wait(RUN_TIMEOUT) for p in processes):
        raise RuntimeError("the plain example failed")
    return time.monotonic() - started


def compare_backends(rounds: int, extra_steps: int) -> Dict[str, Dict[str, float]]:
    """Part 1 (see the module docstring)."""
    long_steps = SHORT_STEPS + extra_steps
    rows: Dict[str, Dict[str, float]] = {}
    short, long = plain_example(SHORT_STEPS), plain_example(long_steps)
    rows["off"] = {"step_ms": (long - short) / extra_steps * 1000}
    for backend in ("mindft", "mindio"):
        with tempfile.TemporaryDirectory() as tmp:
            short = launch_example(backend, SHORT_STEPS, False, Path(tmp))["wall_s"]
        with tempfile.TemporaryDirectory() as tmp:
            long = launch_example(backend, long_steps, False, Path(tmp))["wall_s"]
        recoveries = []
        for _ in range(rounds):
            with tempfile.TemporaryDirectory() as tmp:
                recoveries.append(launch_example(backend, SHORT_STEPS, True, Path(tmp))["recovery_s"])
        rows[backend] = {"step_ms": (long - short) / extra_steps * 1000,
                         "recovery_s": statistics.median(recoveries), "recoveries_s": recoveries}
    return rows


def table(rows: Dict[str, Dict[str, float]]) -> str:
    """The README's table."""
    lines = ["| backend | UCE on 1 of 2 ranks → all resumed (median of runs) | wall time per step |",
             "|---|---|---|"]
    for backend in ("mindft", "mindio"):
        row = rows[backend]
        lines.append(f"| {backend} | {row['recovery_s']:.2f} s ({', '.join(f'{t:.2f}' for t in row['recoveries_s'])}) "
                     f"| {row['step_ms']:.1f} ms |")
    lines.append(f"| (no mindft, two plain processes) | – | {rows['off']['step_ms']:.1f} ms |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and one recovery per size")
    args = parser.parse_args()
    rounds, steps = (1, 300) if args.quick else (3, 2000)
    extra_steps = 100 if args.quick else 200
    backends = compare_backends(rounds, extra_steps)
    print(f"examples/train_mlp.py, mindft-launch --nproc 2, MS_ENABLE_TFT='{{UCE:1}}', UCE in step 6 of rank 1 "
          f"({rounds} recoveries per backend; per step over {extra_steps} extra steps):")
    print(table(backends))
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
               "cpus": os.cpu_count(), "backends": backends, "step_cost": cost, "recovery": recoveries}
    out = ROOT / "bench" / "results" / "mindio.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
