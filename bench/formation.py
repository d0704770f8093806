"""How long MindSpore's cluster takes to form, with MindSpore's heartbeat interval and with mindft's.

A worker of MindSpore 2.10 learns that the cluster formed only from the reply to its next
heartbeat, and sleeps ``MS_RETRY_INTERVAL_LOWER``..``MS_RETRY_INTERVAL_UPPER`` whole seconds
between heartbeats (3..5 by default); mindft-launch sets both to 1 unless the user set either.
The same job runs both ways, interleaved (the order alternates from round to round):

* **MindSpore's 3..5 s**: ``MS_RETRY_INTERVAL_LOWER=3 MS_RETRY_INTERVAL_UPPER=5`` in
  mindft-launch's environment (its defaults, given as a user would: the launcher keeps them);
* **mindft's 1 s**: nothing set, mindft-launch's own ``1``/``1``.

The job is examples/train_dp.py's hand-written loop (``--loop``): 2 ranks on CPU under
mindft-launch (``MS_ENABLE_TFT={RSC:1}``), MindSpore's scheduler, MCCL all-reducing every step,
``--step-seconds`` of sleep per step. Rank 1 SIGKILLs itself in step ``--fault-step``; mindft
restarts every worker behind a new scheduler, each restores from the node agent's memory.
Measured, from the ranks' ``timeline`` lines (wall clock) and the controller's line:

* **cold start**: the launcher started → the first step done on the slowest rank;
* **fault → resumed**: the kill → the first step after the recovery done on the slowest rank;
  and the controller's own "recovery 1 done in X s";
* ``init()`` of the slowest rank, at the cold start and in the restart, split where MindSpore
  logs that the worker saw the cluster formed: **cluster formed** (registration and the
  heartbeat's wait) and **MCCL address exchange** (its fixed 3 s retry).

``--compile-cache`` adds MindSpore's compile cache (``MS_COMPILER_CACHE_ENABLE=1`` with
``MS_COMPILER_CACHE_PATH``): one process compiles and runs one graph-mode training step of
the same network, without the cache and with a cache a previous run filled, interleaved.
(The data-parallel job above runs in PyNative mode, which compiles no graph.)

    python bench/formation.py              # 5 rounds (~6 min on 2 cores)
    python bench/formation.py --quick      # 1 round
Writes bench/results/formation.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port_pair  # bench/ is the script's directory
from recovery import analyse, clean_env, spread, timeline

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_dp.py"
RESULTS = REPO / "bench" / "results" / "formation.json"
WORLD = 2
RUN_TIMEOUT = 300.0
HEARTBEAT = ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER")
VARIANTS = {"default": ("MindSpore's 3..5 s", dict(zip(HEARTBEAT, ("3", "5")))),
            "short": ("mindft's 1 s", {})}
# The third field is the process's name: "python", or the title a warm-forked worker sets ("... [mindft rank 0]").
FORMED = re.compile(r"\[WARNING\] DISTRIBUTED\(\d+,\w+,[^)]*\):(\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d)\.(\d{3})\.(\d{3}) "
                    r"\S+ BuildCluster\] Cluster is successfully initialized")
GRAPH_STEP = """
import time
import mindspore as ms
import numpy as np
from mindspore import nn
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
net = nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4))  # examples/train_dp.py's network
loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
step = nn.TrainOneStepCell(nn.WithLossCell(net, loss), nn.Adam(net.trainable_params(), learning_rate=1e-2))
x, y = ms.Tensor(np.ones((8, 16), np.float32)), ms.Tensor(np.zeros(8, np.int32))
built = time.time()
step(x, y)
print(f"first_step_s={time.time() - built:.6f}")
"""


def run_job(variant: str, args: argparse.Namespace, run_dir: Path) -> dict:
    """One launch of the job with a kill of rank 1 in --fault-step: cold start and recovery times."""
    port = free_port_pair()
    argv = [sys.executable, "-m", "mindft.cli.launch", "--worker_num", str(WORLD), "--local_worker_num", str(WORLD),
            "--master_port", str(port), "--run-dir", str(run_dir), "--cluster_time_out", "120",
            str(SCRIPT), "--loop", "--epochs", str(args.epochs), "--step-seconds", str(args.step_seconds),
            "--fault-step", str(args.fault_step), "--fault-rank", "1", "--fault-kind", "kill", "--timeline",
            "--out", str(run_dir / "out")]
    env = clean_env(MS_ENABLE_TFT="{RSC:1}", MINDFT_RESET_FILE=str(run_dir / "reset.json"),
                    MINDFT_DUMP_DIR=str(run_dir / "dump"))
    for name in HEARTBEAT:  # the shell's own would win over both variants
        env.pop(name, None)
    env.update(VARIANTS[variant][1])
    run_dir.mkdir(parents=True)
    output = run_dir / "launcher.out"
    started = time.time()
    with open(output, "wb") as out:
        launcher = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
    try:
        code = launcher.wait(RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        code = None
    text = output.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"({variant}) mindft-launch exit {code}, see {output}:\n{text[-3000:]}")
    done = re.search(r"recovery 1 done in ([\d.]+) s: .*; resumed after step (\d+)", text)
    if not done or "restarting every worker" not in text:
        raise RuntimeError(f"({variant}) no restart of every worker / 'recovery 1 done' line, see {output}")
    events = timeline(text)
    row = analyse(events, args.fault_step, int(done[2]), restarted=True)

    def slowest(event: str, restart: int, step: int | None = None) -> float:
        times = [e["t"] for e in events if e["event"] == event and e["restart"] == restart
                 and (step is None or e["step"] == step)]
        if len(times) != WORLD:
            raise RuntimeError(f"({variant}) {event!r} of incarnation {restart} logged {len(times)} times, "
                               f"see {output}")
        return max(times)

    # init() as recovery.py's phases count it (the slowest rank's imports done → its init() done),
    # split where MindSpore logs that the worker saw the cluster formed: before, registration and
    # the heartbeat wait; after, MCCL's address exchange.
    formed = cluster_formed(run_dir / "logs", variant)
    for restart, name in ((0, "cold"), (1, "restart")):
        row[f"{name}_init_s"] = slowest("initialized", restart) - slowest("imported", restart)
        row[f"{name}_formed_s"] = max(times[restart] for times in formed) - slowest("imported", restart)
        row[f"{name}_mccl_s"] = slowest("initialized", restart) - max(times[restart] for times in formed)
    row.update(variant=variant, controller_recovery_s=float(done[1]),
               cold_start_s=slowest("step", 0, step=1) - started)
    return row


def cluster_formed(logs: Path, variant: str) -> list[list[float]]:
    """Per rank, the wall-clock times (one per incarnation) its MindSpore logged "Cluster is
    successfully initialized": the worker saw the cluster formed; MCCL's address exchange follows."""
    formed = []
    for rank in range(WORLD):
        stamps = FORMED.findall((logs / f"rank_{rank}.log").read_text(errors="replace"))
        if len(stamps) != 2:
            raise RuntimeError(f"({variant}) rank {rank} logged the cluster formed {len(stamps)} times, expected 2; "
                               f"see {logs}")
        formed.append([time.mktime(time.strptime(day, "%Y-%m-%d-%H:%M:%S")) + int(ms) / 1e3 + int(us) / 1e6
                       for day, ms, us in stamps])  # MindSpore logs local time
    return formed


def run_graph_step(workdir: Path, cache: Path | None) -> float:
    """Seconds of the first graph-mode step of a fresh process in ``workdir``, compiled, or loaded
    from ``cache`` (filled by the first run that uses it)."""
    env = clean_env()
    if cache is not None:
        env.update(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=str(cache))
    script = workdir / "graph_step.py"  # a file: the cache hashes the entry script to know it is still valid
    if not script.exists():
        script.write_text(GRAPH_STEP)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=False,
                          timeout=RUN_TIMEOUT, cwd=workdir)
    found = re.search(r"first_step_s=([\d.]+)", done.stdout)
    if done.returncode or not found:
        raise RuntimeError(f"graph-mode step failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return float(found[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round instead of --rounds")
    parser.add_argument("--rounds", type=int, default=5, help="both heartbeat intervals, interleaved, this many times")
    parser.add_argument("--fault-step", type=int, default=10, help="the step in which rank 1 is killed (of 32)")
    parser.add_argument("--step-seconds", type=float, default=0.1, help="sleep per step, standing in for compute")
    parser.add_argument("--epochs", type=int, default=2, help="16 steps per epoch")
    parser.add_argument("--compile-cache", action="store_true", help="also measure MindSpore's compile cache")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, help="keep each run's directory (logs, launcher output) under KEEP")
    args = parser.parse_args()
    if not 1 < args.fault_step <= 16 * args.epochs:
        parser.error(f"--fault-step {args.fault_step}: must be in 2..{16 * args.epochs} (steps of the job)")

    rounds = 1 if args.quick else args.rounds
    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    cache_rows: dict[str, list[float]] = {"compiled": [], "cached": []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mindft-bench-formation-") as scratch:
        tmp = Path(args.keep or scratch)
        if args.compile_cache:
            run_graph_step(tmp, tmp / "cache")  # fills the cache the "cached" runs load
        for index in range(rounds):
            order = list(VARIANTS) if index % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                row = run_job(variant, args, tmp / f"{variant}{index}")
                row["load_after"] = os.getloadavg()[0]
                rows[variant].append(row)
                print(f"  round {index + 1}/{rounds} ({VARIANTS[variant][0]}) cold start {row['cold_start_s']:.2f} s "
                      f"(init {row['cold_init_s']:.2f} s), fault → resumed {row['fault_to_resumed_s']:.2f} s "
                      f"(init {row['restart_init_s']:.2f} s), load {row['load_after']:.1f}", flush=True)
            if args.compile_cache:
                for kind in (("compiled", "cached") if index % 2 == 0 else ("cached", "compiled")):
                    cache_rows[kind].append(run_graph_step(tmp, tmp / "cache" if kind == "cached" else None))
    load_after = os.getloadavg()

    default, short = rows["default"], rows["short"]
    measures = (("cold start → first step, s", "cold_start_s"), ("  init(), s", "cold_init_s"),
                ("    cluster formed, s", "cold_formed_s"), ("    MCCL address exchange, s", "cold_mccl_s"),
                ("fault → resumed, s", "fault_to_resumed_s"), ("  init(), s", "restart_init_s"),
                ("    cluster formed, s", "restart_formed_s"), ("    MCCL address exchange, s", "restart_mccl_s"),
                ("controller: recovery, s", "controller_recovery_s"))
    ratios = {key: [d[key] / s[key] for d, s in zip(default, short)] for _, key in measures}
    print()
    print(f"{WORLD} ranks, CPU, MCCL all-reduce, mindft-launch; {16 * args.epochs} steps of ~{args.step_seconds} s; "
          f"rank 1 killed in step {args.fault_step}, every worker restarted; {rounds} round(s), median (min–max); "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    width = 26
    print(f"{'':<32}" + "".join(f"{label:>{width}}" for label, _ in VARIANTS.values()) + f"{'ratio':>{width}}")
    for label, key in measures:
        print(f"{label:<32}{spread([r[key] for r in default]):>{width}}{spread([r[key] for r in short]):>{width}}"
              f"{spread(ratios[key]):>{width}}")
    if args.compile_cache:
        compiled, cached = cache_rows["compiled"], cache_rows["cached"]
        print(f"graph-mode first step, one process: compiled {spread(compiled, digits=3)} s, from the compile "
              f"cache {spread(cached, digits=3)} s; ratio {spread([c / k for c, k in zip(compiled, cached)])}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "formation",
        "config": {"ranks": WORLD, "epochs": args.epochs, "step_seconds": args.step_seconds,
                   "fault_step": args.fault_step, "rounds": rounds,
                   "variants": {name: env for name, (_, env) in VARIANTS.items()}},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_before": load_before,
                    "loadavg_after": load_after},
        "rows": rows, "ratios_default_over_short": ratios,
        "compile_cache": cache_rows if args.compile_cache else None}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
