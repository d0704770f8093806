"""Step time and memory of a 2-rank job whose replicas are pushed, streamed, or not made at all.

Each rank trains an MLP with Adam in MindSpore PyNative mode through ``FaultTolerantLoop`` and
records its step times and its peak RSS. Two ways to run the job:

**By hand, no node agent** (as under msrun): a controller process and two rank processes on
127.0.0.1, CurveZMQ on; each rank keeps its buddy's replica in its own memory.

- ``hand_plain``: MS_ENABLE_TFT unset (no mindft at all), the floor;
- ``hand_sync``: mindft at ``--old`` (default the commit before rank streaming, exported with
  ``git archive``): after each capture the rank re-reads and pushes its snapshot to its buddy over a
  new socket (a CurveZMQ handshake each time) and waits for it before it reports the step;
- ``hand_async``: this tree: the rank streams its newest snapshot to its buddy's keeper in the
  background over one connection; only the step's report waits for the replica;
- ``hand_budget``: this tree with the cadence the overhead budget chooses (the others snapshot
  every step, ``--every``); it chooses up to every 100th step, so give it the steps to show
  its steady state: ``--modes hand_plain,hand_budget --steps 240`` (two whole periods once settled).

**Two nodes under mindft-launch** (two launchers on loopback, one rank each):

- ``none``: MS_ENABLE_TFT unset; ``rank_stream``: MINDFT_AGENT_REPLICATION=0, the ranks stream
  as ``hand_async`` does (their own snapshots live in the agent's shared memory);
- ``agent``: the node agents stream the newest snapshots (the default);
- ``agent_budget``: as ``agent``, with the cadence the overhead budget chooses: mindft-launch's
  defaults on several nodes (``--modes none,agent_budget --steps 240``).

Modes run interleaved round by round, so they see the same machine. Reported per mode: the mean
step time of each job over whole snapshot periods past the warm-up (a median would hide a snapshot
every N-th step; the median is recorded too), min/median/max over rounds, the ratio to the plain
job of its setup, replicas confirmed and lost-protection warnings, the load average before and
after each job, and each rank's peak RSS above the plain job's, in units of the state's size.

    python bench/replication.py [--width 4096] [--steps 40] [--rounds 3] [--modes hand_plain,hand_sync,...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from _common import free_port_pair  # bench/ is the script's directory
from step_cost import export_old
from train_overhead_ranks import whole_periods

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "replication.json"
HAND_MODES = ("hand_plain", "hand_sync", "hand_async", "hand_budget")
LAUNCH_MODES = ("none", "rank_stream", "agent", "agent_budget")
FLOOR = {mode: "hand_plain" for mode in HAND_MODES} | {mode: "none" for mode in LAUNCH_MODES}
OLD_REF = "4468e9d"  # main before ranks streamed: the per-step synchronous push
WARMUP = 5
IN_OUT = 1024
RANK_VARIABLE = "BENCH_REPLICATION_OUT"


def rank_main() -> None:
    """One rank: train, time every step, write the times and peak RSS to $BENCH_REPLICATION_OUT/rank<R>.json."""
    import resource

    import mindspore as ms
    import numpy as np
    from mindspore import nn

    from mindft.config import load_config
    from mindft.mindspore import FaultTolerantLoop

    width, steps, batch = (int(os.environ[f"BENCH_REPLICATION_{name}"]) for name in ("WIDTH", "STEPS", "BATCH"))
    config = load_config()
    ms.set_device("CPU")
    # Weights and data differ per rank: equal weights (data-parallel) would let a keeper point into
    # its own snapshot and send no array at all; here every replica is the whole state.
    ms.set_seed(config.rank)
    net = nn.SequentialCell(nn.Dense(IN_OUT, width), nn.ReLU(), nn.Dense(width, width), nn.ReLU(),
                            nn.Dense(width, IN_OUT))
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-4)
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    train_step.set_train()
    rng = np.random.default_rng(config.rank)
    x = ms.Tensor(rng.random((batch, IN_OUT), dtype=np.float32))
    y = ms.Tensor(rng.random((batch, IN_OUT), dtype=np.float32))

    def run(xb: ms.Tensor, yb: ms.Tensor) -> None:
        train_step(xb, yb).asnumpy()

    times, stats = [], {}
    with FaultTolerantLoop(net, optimizer) as loop:
        for _ in range(steps):
            start = time.perf_counter()
            loop.step(run, x, y)
            times.append(time.perf_counter() - start)
        state = sum(p.asnumpy().nbytes for p in train_step.get_parameters())
        session = loop.session
        replication = getattr(session, "_replication", None)
        if replication is not None:
            sender = replication.sender
            stats = {"pushes": sender.pushes, "skipped": sender.skipped, "push_timeouts": sender.timeouts,
                     "replicated": sender.replicated.get(config.rank, -1), "push_s": sender.push_seconds,
                     "shared_arrays": sender.shared_arrays}
        processor = getattr(session, "processor", None)
        if processor is not None:
            schedule = processor.follower.schedule
            stats["snapshot_every"] = processor.follower.snapshot_every
            settled = schedule.segments[-1][0]  # the budget's adaptation happens before
            stats["captures"] = [step for step in range(settled, steps + 1) if step and schedule.is_capture(step)]
    out = Path(os.environ[RANK_VARIABLE])
    (out / f"rank{config.rank}.json").write_text(json.dumps({
        "times": times, "state_bytes": state, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **stats}))


def base_env(args: argparse.Namespace, out: Path, work: Path, tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "MINDFT_", "RANK_"))}
    env.update(PYTHONPATH=str(tree), **{RANK_VARIABLE: str(out)}, GLOG_v="3",
               BENCH_REPLICATION_WIDTH=str(args.width), BENCH_REPLICATION_STEPS=str(args.steps),
               BENCH_REPLICATION_BATCH=str(args.batch), MINDFT_RESET_FILE=str(work / "reset.json"),
               MINDFT_REGISTER_TIMEOUT="300", MINDFT_DUMP_DIR=str(out / "dump"))
    return env


def run_hand(mode: str, args: argparse.Namespace, keys: Path, out: Path, work: Path, old: Optional[Path]) -> str:
    """A controller and two ranks started by hand; returns their output."""
    tree = old if mode == "hand_sync" else REPO
    env = base_env(args, out, work, tree)
    env.update(MS_WORKER_NUM="2", MS_TFT_IP="127.0.0.1", MINDFT_KEY_FILE=str(keys))
    if mode != "hand_budget":
        env["MINDFT_SNAPSHOT_EVERY"] = str(args.every)
    processes, logs = [], []
    if mode != "hand_plain":
        port = free_port_pair()
        env.update(MS_ENABLE_TFT="{RSC:1}", MS_TFT_PORT=str(port))
        logs.append(out / "controller.out")
        with open(logs[-1], "wb") as handle:
            # cwd: `python -m` puts it first on sys.path, before PYTHONPATH: the tree's own controller.
            processes.append(subprocess.Popen([sys.executable, "-m", "mindft.controller"],
                                              env=dict(env, MINDFT_LOG_LEVEL="WARNING"), stdout=handle, cwd=tree,
                                              stderr=subprocess.STDOUT, start_new_session=True))
    for rank in (0, 1):
        logs.append(out / f"rank{rank}.out")
        with open(logs[-1], "wb") as handle:
            processes.append(subprocess.Popen([sys.executable, __file__], env=dict(env, MS_NODE_ID=str(rank)),
                                              cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                              start_new_session=True))
    return wait_all(mode, processes, logs, args.timeout)


def run_launch(mode: str, args: argparse.Namespace, keys: Path, out: Path, work: Path) -> str:
    """Two mindft-launch processes on loopback as two nodes, one rank each; returns their output."""
    port = free_port_pair()
    env = base_env(args, out, work, REPO)
    env.update(MINDFT_AGENT_REPLICATION="0" if mode == "rank_stream" else "1")
    if mode != "agent_budget":
        env["MINDFT_SNAPSHOT_EVERY"] = str(args.every)
    if mode != "none":
        env["MS_ENABLE_TFT"] = "{RSC:1}"
    processes, logs = [], []
    for node in (1, 0):
        logs.append(out / f"node{node}.out")
        with open(logs[-1], "wb") as handle:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "mindft.cli.launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node),
                 "--master-port", str(port), "--no-scheduler", "--key-file", str(keys), "--run-dir",
                 str(out / f"run{node}"), __file__], env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                start_new_session=True))
    return wait_all(mode, processes, logs, args.timeout)


def wait_all(mode: str, processes: list, logs: list, timeout: float) -> str:
    try:
        codes = [process.wait(timeout) for process in reversed(processes)]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)
    text = "\n".join(path.read_text(errors="replace") for path in logs)
    if any(codes):
        raise SystemExit(f"{mode}: processes exited {codes}:\n{text[-4000:]}")
    return text


def whole_periods_mean(times: list, captures: list) -> float:
    """The mean step over whole snapshot periods (:func:`whole_periods`) once the cadence settled;
    a median would hide a snapshot every N-th step. No captures (no mindft): every step past the
    warm-up."""
    first, last = whole_periods(captures, WARMUP, len(times))
    return statistics.fmean(times[first - 1:last])


def run_job(mode: str, args: argparse.Namespace, keys: Path, work: Path, old: Optional[Path]) -> dict:
    out = work / mode
    out.mkdir(parents=True)
    load_before = os.getloadavg()
    if mode in HAND_MODES:
        text = run_hand(mode, args, keys, out, work, old)
    else:
        text = run_launch(mode, args, keys, out, work)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    means = [whole_periods_mean(r["times"], r.get("captures", [])) for r in ranks]
    medians = [statistics.median(r["times"][WARMUP:]) for r in ranks]
    sent = [int(n) for n in re.findall(r"replication: sent (\d+) replica", text)]
    return {"mode": mode, "step_ms": max(means) * 1e3, "per_rank_ms": [m * 1e3 for m in means],
            "median_ms": max(medians) * 1e3,
            "state_bytes": ranks[0]["state_bytes"], "peak_rss": [r["peak_rss"] for r in ranks],
            "pushes": [r.get("pushes") for r in ranks], "skipped": [r.get("skipped") for r in ranks],
            "shared_arrays": [r.get("shared_arrays") for r in ranks],
            "push_s": [r.get("push_s") for r in ranks], "snapshot_every": [r.get("snapshot_every") for r in ranks],
            "agent_replicas_sent": sum(sent) if sent else None,
            "lost_protection_warnings": text.count("LOST PROTECTION"),
            "push_failures": text.count("replica push of step"),
            "load_before": load_before, "load_after": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4096, help="hidden width of the MLP (4096: ~25.2M parameters)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--every", type=int, default=1, help="snapshot cadence of every mode but the budget's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(HAND_MODES),
                        help=f"comma-separated, of {', '.join(HAND_MODES + LAUNCH_MODES)}")
    parser.add_argument("--old", default=OLD_REF, help=f"the git ref hand_sync runs (default {OLD_REF})")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(HAND_MODES + LAUNCH_MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; known: {', '.join(HAND_MODES + LAUNCH_MODES)}")
    floors = {FLOOR[m] for m in modes} - set(modes)
    if floors:
        parser.error(f"--modes: include {sorted(floors)}, the plain job the others are compared with")
    jobs = []
    with tempfile.TemporaryDirectory(prefix="mindft-bench-replication-") as tmp:
        work = Path(tmp)
        keys = work / "keys.json"
        subprocess.run([sys.executable, "-c", "from mindft.cli.main import main; main()", "keygen", str(keys)], check=True,
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True)
        old = None
        if "hand_sync" in modes:
            old = work / "old"
            old.mkdir()
            failure = export_old(args.old, old)
            if failure:
                raise SystemExit(failure)
        for round_ in range(args.rounds):
            for mode in modes:
                job = run_job(mode, args, keys, work / f"round{round_}", old)
                job["round"] = round_
                jobs.append(job)
                print(f"round {round_} {mode:>11}: step {job['step_ms']:7.1f} ms, median {job['median_ms']:.1f}  (ranks {job['per_rank_ms'][0]:.1f}, "
                      f"{job['per_rank_ms'][1]:.1f}; peak RSS {job['peak_rss'][0] / 2**20:.0f}, "
                      f"{job['peak_rss'][1] / 2**20:.0f} MiB; pushes {job['pushes']} (arrays not sent: {job['shared_arrays']}), cadence {job['snapshot_every']}, "
                      f"lost-protection warnings {job['lost_protection_warnings']}; load "
                      f"{job['load_before'][0]:.2f}→{job['load_after'][0]:.2f})", flush=True)
    state = jobs[0]["state_bytes"]
    by_round = {(j["round"], j["mode"]): j for j in jobs}
    summary = {}
    for mode in modes:
        values = [j["step_ms"] for j in jobs if j["mode"] == mode]
        ratios = [by_round[(r, mode)]["step_ms"] / by_round[(r, FLOOR[mode])]["step_ms"] for r in range(args.rounds)]
        extra = [(by_round[(r, mode)]["peak_rss"][k] - by_round[(r, FLOOR[mode])]["peak_rss"][k]) / state
                 for r in range(args.rounds) for k in (0, 1)]
        summary[mode] = {"min_ms": min(values), "median_ms": statistics.median(values), "max_ms": max(values),
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "extra_rss_states_max": max(extra), "extra_rss_states_median": statistics.median(extra)}
    result = {"benchmark": "replication", "width": args.width, "batch": args.batch, "steps": args.steps,
              "every": args.every, "old": args.old, "state_bytes": state, "rounds": args.rounds,
              "cpus": os.cpu_count(), "machine": platform.platform(), "jobs": jobs, "summary": summary}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    print(f"state per rank {state / 2**20:.0f} MiB; mean step over whole snapshot periods, over rounds (min/median/max), ratio to the plain "
          f"job of the same round (median, min-max), peak RSS per rank above the plain job's (states, median/max):")
    for mode in modes:
        s = summary[mode]
        print(f"  {mode:>11}: {s['min_ms']:.1f} / {s['median_ms']:.1f} / {s['max_ms']:.1f} ms   ratio "
              f"{s['ratio_median']:.2f} ({s['ratio_min']:.2f}-{s['ratio_max']:.2f})   RSS +"
              f"{s['extra_rss_states_median']:.2f} / +{s['extra_rss_states_max']:.2f} states")


if __name__ == "__main__":
    if os.environ.get(RANK_VARIABLE):
        rank_main()
    else:
        main()
