"""Goodput of one data-parallel job under a seeded schedule of faults: mindft against kill-all-and-reload.

The job is examples/train_dp.py's hand-written loop: 2 ranks on CPU, MindSpore's scheduler, MCCL
all-reducing every step's gradients, ``--step-seconds`` of sleep per step standing in for compute,
and as many epochs as make the fault-free job train for about ``--minutes``. The schedule
(``--seed``) puts faults at exponentially distributed times of the run (mean ``--mtbf`` seconds,
none in its last fifth), a killed rank, a UCE and a hot reset in turn, each of a random rank. Both ways run
the same job under the same schedule, one after the other:

* (a) **mindft** (mindft-launch, ``MS_ENABLE_TFT='{RSC:1}'``): ``mindft inject --fault kill``,
  ``--fault uce``, and ``mindft simulate-device-plugin`` (the chip reset once its process left,
  ``recovered`` a second later) at each fault's time;
* (b) **kill all and reload** (TaskD's way; bench/recovery.py's agent and ranks): the ranks write
  ``mindspore.save_checkpoint`` every ``--checkpoint-every`` steps; every fault ends a worker (a UCE
  raised without mindft ends the script; the device plugin resets a chip only once its process
  left), so at each fault's time this file kills the rank, then, as TaskD does, every worker and
  the scheduler, and starts them again from the newest checkpoint every rank wrote.

A fault due while the job is not training (a recovery, a restart) waits until it trains again.
Goodput is the same yardstick for both: the job's steps × the bare job's step time (the median
interval between two steps of (b) with no checkpoint between them: no mindft, no save) over the wall
time from the launch to the last step. Where the rest went: (a) the controller's own buckets (its
event log, mindft.flow.goodput); (b) from the ranks' timelines: start-ups (a start to the first
step after it), steps replayed, and the rest (checkpoint saves, detection, the kills). The final
weights of (a) and (b) are compared: both must be those of a run without faults.

    python bench/goodput.py              # 3 minutes of training per way (~9 min on 2 cores)
    python bench/goodput.py --quick      # 40 s per way
Writes bench/results/goodput.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from _common import free_port, free_port_pair  # bench/ is the script's directory
from recovery import SCHEDULER_COMMAND, WORLD, clean_env, same_weights, timeline

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_dp.py"
RECOVERY = Path(__file__).resolve().parent / "recovery.py"
RESULTS = REPO / "bench" / "results" / "goodput.json"
STEPS_PER_EPOCH = 16  # 256 samples, batch 8 per rank, 2 ranks
KINDS = ("kill", "uce", "hot-reset")


def schedule(seed: int, seconds: float, mtbf: float) -> list[tuple[float, str, int]]:
    """(seconds after the launch, kind, rank) of every fault: exponential gaps of mean ``mtbf``,
    none in the last fifth of ``seconds`` (a fault there would only test the end)."""
    rng, at, faults = random.Random(seed), 0.0, []
    while True:
        at += rng.expovariate(1.0 / mtbf)
        if at > 0.8 * seconds:
            return faults
        faults.append((round(at, 2), KINDS[len(faults) % len(KINDS)], rng.randrange(WORLD)))


def job_args(args: argparse.Namespace, epochs: int) -> list[str]:
    return ["--loop", "--epochs", str(epochs), "--step-seconds", str(args.step_seconds), "--timeline"]


def last_step(events: list[dict]) -> float:
    """When the job's last step ended (the ranks' wall clock)."""
    return max(e["t"] for e in events if e["event"] == "step")


def step_time(events: list[dict], checkpoint_every: int = 0) -> float:
    """The fault-free step time: the median interval between consecutive steps of one incarnation."""
    by_rank: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for event in events:
        if event["event"] == "step":
            by_rank.setdefault((event["rank"], event["restart"]), []).append((event["step"], event["t"]))
    gaps = [t2 - t1 for points in by_rank.values() for (s1, t1), (s2, t2) in zip(points, points[1:])
            if s2 == s1 + 1 and not (checkpoint_every and s1 % checkpoint_every == 0)]
    return statistics.median(gaps)


class Faults:
    """The schedule, played against a run: each fault when due and the job trains."""

    def __init__(self, faults: list[tuple[float, str, int]], started: float) -> None:
        self.pending, self.started, self.hit = list(faults), started, []

    def due(self, training: bool) -> Optional[tuple[float, str, int]]:
        if self.pending and training and time.monotonic() - self.started >= self.pending[0][0]:
            fault = self.pending.pop(0)
            self.hit.append({"at": round(time.monotonic() - self.started, 2), "kind": fault[1], "rank": fault[2]})
            return fault
        return None


# ---- (a) mindft ---------------------------------------------------------------------------------

def run_mindft(args: argparse.Namespace, epochs: int, run_dir: Path,
               faults: list[tuple[float, str, int]]) -> dict:
    sys.path.insert(0, str(REPO))
    from mindft.net.channel import Client, ControllerUnreachable
    from mindft.net.keys import load_keys
    from mindft.observe.events import JobFinished, read

    port = free_port_pair()
    argv = [sys.executable, "-m", "mindft.cli.launch", "--worker_num", str(WORLD), "--local_worker_num", str(WORLD),
            "--master_port", str(port), "--run-dir", str(run_dir), "--cluster_time_out", "120",
            str(SCRIPT), *job_args(args, epochs), "--out", str(run_dir / "out")]
    env = clean_env(MS_ENABLE_TFT="{RSC:1}", MINDFT_RESET_FILE=str(run_dir / "reset.json"),
                    MINDFT_DUMP_DIR=str(run_dir / "dump"))
    run_dir.mkdir(parents=True)
    output, job_file = run_dir / "launcher.out", run_dir / "job.json"
    helpers: list[subprocess.Popen] = []
    launched = time.time()
    with open(output, "wb") as out:
        launcher = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
    started = time.monotonic()
    played, client = Faults(faults, started), None
    try:
        while launcher.poll() is None:
            time.sleep(0.1)
            if client is None and job_file.exists():
                info = json.loads(job_file.read_text())
                client = Client(info["controller"], None if info["insecure"] else load_keys(Path(info["key_file"])),
                                timeout=1.0)
            try:
                training = client is not None and client.status().state == "NORMAL"
            except ControllerUnreachable:
                training = False
            fault = played.due(training)
            if fault is None:
                continue
            _, kind, rank = fault
            if kind == "hot-reset":
                command = ["simulate-device-plugin", "--job", str(job_file), "--rank", str(rank), "--hold", "1"]
            else:
                command = ["inject", "--job", str(job_file), "--rank", str(rank), "--fault", kind]
            helpers.append(subprocess.Popen([sys.executable, "-m", "mindft.cli.main", *command], env=env, cwd=REPO,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            if kind != "hot-reset":
                helpers[-1].wait(30)
        code = launcher.wait()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for helper in helpers:
            if helper.poll() is None:
                helper.kill()
                helper.wait()
    text = output.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"(a) mindft-launch exit {code}, see {output}:\n{text[-3000:]}")
    events = timeline(text)
    (finish,) = [e.record for e in read(run_dir) if isinstance(e.record, JobFinished)]
    return {"way": "a", "events": events, "faults": played.hit, "buckets_s": finish.seconds,
            "launch_to_end_s": last_step(events) - launched}


# ---- (b) kill all and reload -----------------------------------------------------------------------

def run_kill_all(args: argparse.Namespace, epochs: int, run_dir: Path,
                 faults: list[tuple[float, str, int]]) -> dict:
    port = free_port()
    logs, checkpoints = run_dir / "logs", run_dir / "checkpoints"
    logs.mkdir(parents=True)
    cluster = {"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(port), "MS_WORKER_NUM": str(WORLD),
               "MS_TOPO_TIMEOUT": "120", "RANK_SIZE": str(WORLD)}
    everything: list[subprocess.Popen] = []

    def start(restart: int, resume_step: int) -> list[subprocess.Popen]:
        with open(logs / "scheduler.log", "ab") as log:
            everything.append(subprocess.Popen([sys.executable, *SCHEDULER_COMMAND], stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True,
                                               env=clean_env(**cluster, MS_ROLE="MS_SCHED", RANK_ID="0")))
        workers = []
        for rank in range(WORLD):
            with open(logs / f"rank_{rank}.log", "ab") as log:
                workers.append(subprocess.Popen(
                    [sys.executable, str(RECOVERY), "--checkpoint-worker", *job_args(args, epochs)[1:],
                     "--checkpoint-every", str(args.checkpoint_every), "--checkpoint-dir", str(checkpoints),
                     "--resume-step", str(resume_step), "--out", str(run_dir / "out")],
                    env=clean_env(**cluster, MS_ROLE="MS_WORKER", MS_NODE_ID=str(rank), RANK_ID=str(rank),
                                  DEVICE_ID=str(rank), LOCAL_RANK=str(rank), MINDFT_RESTART_COUNT=str(restart)),
                    stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True))
        everything.extend(workers)
        return workers

    def trained_since(restart: int) -> bool:
        text = "".join((logs / f"rank_{r}.log").read_text(errors="replace") for r in range(WORLD))
        return any(e["event"] == "step" and e["restart"] == restart for e in timeline(text))

    launched = time.time()
    started = time.monotonic()
    played, restart, resumes = Faults(faults, started), 0, [0]
    try:
        workers = start(0, 0)
        while not all(w.poll() == 0 for w in workers):
            time.sleep(0.05)
            fault = played.due(trained_since(restart))
            failed = any(w.poll() not in (None, 0) for w in workers)
            if fault is None and not failed:
                continue
            if fault is not None:
                os.killpg(workers[fault[2]].pid, signal.SIGKILL)  # whatever the fault, the rank's process ends
            for process in everything:  # TaskD: kill every worker and the cluster with them
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            held = [{int(p.name[4:-5]) for p in (checkpoints / f"rank{r}").glob("step*.ckpt")} for r in range(WORLD)]
            restart += 1
            resumes.append(max(set.intersection(*held), default=0))
            workers = start(restart, resumes[-1])
    finally:
        for process in everything:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    text = "".join((logs / f"rank_{r}.log").read_text(errors="replace") for r in range(WORLD))
    events = timeline(text)
    return {"way": "b", "events": events, "faults": played.hit, "resumed_after": resumes,
            "launch_to_end_s": last_step(events) - launched}


# ---- goodput ---------------------------------------------------------------------------------------

def goodput(row: dict, steps: int, step_seconds: float) -> dict:
    """Productive time (every step once, at the fault-free step time) over the wall time, and the rest."""
    wall = row["launch_to_end_s"]
    productive = steps * step_seconds
    result = {"wall_s": wall, "productive_s": productive, "goodput": productive / wall, "faults": len(row["faults"])}
    if row["way"] == "b":
        events, first_steps = row["events"], {}
        for event in events:
            if event["event"] == "step":
                key = event["restart"]
                first_steps[key] = min(first_steps.get(key, event["t"]), event["t"])
        starts = {}
        for event in events:
            if event["event"] == "created":
                starts[event["restart"]] = min(starts.get(event["restart"], event["t"]), event["t"])
        startup = sum(first_steps[k] - starts[k] - step_seconds for k in first_steps if k in starts)
        replayed = sum(max(0, _newest_step(events, k - 1) - resumed)
                       for k, resumed in enumerate(row["resumed_after"]) if k > 0) * step_seconds
        result["buckets_s"] = {"start-ups": startup, "replayed": replayed,
                               "checkpoints, detection, kills": wall - productive - startup - replayed}
    else:
        result["buckets_s"] = {name: seconds for name, seconds in row["buckets_s"].items() if name != "productive"}
        result["controller_goodput"] = row["buckets_s"]["productive"] / sum(row["buckets_s"].values())
    return result


def _newest_step(events: list[dict], restart: int) -> int:
    """The newest step incarnation ``restart`` of the ranks finished."""
    return max((e["step"] for e in events if e["event"] == "step" and e["restart"] == restart), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 s of training per way instead of --minutes")
    parser.add_argument("--minutes", type=float, default=3.0, help="the fault-free job's training time")
    parser.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=1, help="of the fault schedule")
    parser.add_argument("--step-seconds", type=float, default=0.1, help="sleep per step, standing in for compute")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="(b): save_checkpoint every N steps")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, help="keep each run's directory under KEEP")
    args = parser.parse_args()
    seconds = 40.0 if args.quick else 60.0 * args.minutes
    if args.mtbf <= 0 or args.step_seconds <= 0 or args.checkpoint_every < 1:
        parser.error("--mtbf and --step-seconds must be positive, --checkpoint-every at least 1")
    # The fault-free pace of this job here: ~step-seconds plus a few ms of compute and all-reduce.
    epochs = max(2, round(seconds / (args.step_seconds + 0.01) / STEPS_PER_EPOCH))
    steps = epochs * STEPS_PER_EPOCH
    faults = schedule(args.seed, seconds, args.mtbf)
    print(f"{WORLD} ranks, {steps} steps of ~{args.step_seconds} s; faults (s after the launch, kind, rank): "
          f"{faults}", flush=True)

    import tempfile
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mindft-bench-goodput-") as scratch:
        tmp = Path(args.keep or scratch)
        rows = {"a": run_mindft(args, epochs, tmp / "a", faults)}
        print(f"  (a) mindft: {len(rows['a']['faults'])} faults, {rows['a']['launch_to_end_s']:.0f} s", flush=True)
        rows["b"] = run_kill_all(args, epochs, tmp / "b", faults)
        print(f"  (b) kill all and reload: {len(rows['b']['faults'])} faults, {rows['b']['launch_to_end_s']:.0f} s",
              flush=True)
        identical = same_weights({"a": tmp / "a" / "out", "b": tmp / "b" / "out"})
    load_after = os.getloadavg()
    pace = step_time(rows["b"]["events"], args.checkpoint_every)  # the bare job's step: no mindft, no checkpoint
    results = {way: goodput(row, steps, pace) for way, row in rows.items()}
    print()
    print(f"{WORLD} ranks, CPU, MCCL all-reduce; {steps} steps at {pace * 1000:.0f} ms (the bare job's); faults every "
          f"~{args.mtbf:g} s (seed {args.seed}); (b) checkpoints every {args.checkpoint_every} steps; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    for way, label in (("a", "(a) mindft"), ("b", "(b) kill all and reload")):
        r = results[way]
        rest = ", ".join(f"{name} {value:.1f} s" for name, value in r["buckets_s"].items() if value >= 0.05)
        print(f"{label:<26} goodput {100 * r['goodput']:5.1f}% of {r['wall_s']:.0f} s, {r['faults']} faults; "
              f"the rest: {rest}")
    print(f"(a)'s controller says {100 * results['a']['controller_goodput']:.1f}% (its own buckets)")
    print(f"ratio of goodput (a)/(b): {results['a']['goodput'] / results['b']['goodput']:.2f}")
    print(f"final weights of (a) and (b) bit-identical: {'yes' if identical else 'NO'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "goodput", "config": {"ranks": WORLD, "steps": steps, "step_seconds": args.step_seconds,
                                           "mtbf": args.mtbf, "seed": args.seed, "faults": faults,
                                           "checkpoint_every": args.checkpoint_every, "seconds": seconds},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_before": load_before,
                    "loadavg_after": load_after},
        "step_seconds_measured": pace, "results": results,
        "faults_hit": {way: row["faults"] for way, row in rows.items()}, "weights_identical": identical}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
