"""Fault → training resumed, and steps lost, for three ways of recovering the same data-parallel job.

The job is examples/train_dp.py's hand-written loop (``--loop``): 2 ranks on CPU, MindSpore's
scheduler, MCCL all-reducing the gradients of every step, ``--step-seconds`` of sleep per step
standing in for compute. Each way of recovering is run on it, interleaved in one run:

* (a) **in-place rollback** (mindft-launch, ``--fault-kind uce-after``): a device error raised on
  one rank after the step's all-reduce and update; every rank reaches the step boundary, the
  controller rolls the job back one step inside the running processes (no worker restarted);
* (b) **restart from the node agents' memory** (mindft-launch, ``--fault-kind exit``): one rank
  exits as if killed -9 before its all-reduce; mindft's restart-all rung kills the other worker,
  starts a new scheduler and every worker, and each restores its snapshot from the agent's
  shared memory (the step every rank holds);
* (c) **TaskD's way, disk checkpoints** (this file plays the agent): the same fault in the same
  job without mindft (``MS_ENABLE_TFT`` unset); the ranks write ``mindspore.save_checkpoint``
  every ``--checkpoint-every`` steps; on the fault the agent kills every worker and the scheduler
  at once, starts them again, and each rank loads the newest checkpoint every rank wrote and
  trains on from there.

Times come from the ranks' ``timeline`` lines (wall clock, same machine): the fault, and for
restarted workers process start (/proc), imports done, ``init()`` done (cluster formed), data and
model built, restored/loaded, first step done, the faulted step done again. "Resumed" is the end
of the first step after the recovery on the slowest rank. Steps replayed = fault step − the step
training resumed after (1 means only the faulted step is redone); lost = replayed − 1.
Final weights of the three are compared bit for bit.

    python bench/recovery.py             # 3 rounds of (a), (b), (c) interleaved (~4 min on 2 cores)
    python bench/recovery.py --quick     # 1 round
Writes bench/results/recovery.json.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import free_port, free_port_pair  # bench/ is the script's directory

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_dp.py"
RESULTS = REPO / "bench" / "results" / "recovery.json"
WORLD = 2
TARGET = 3.0  # (c)/(b), with no step lost beyond the rollback
RUN_TIMEOUT = 300.0
SCHEDULER_COMMAND = ("-c", "from mindspore.communication import init; init()")
TIMELINE = re.compile(r"timeline rank=(\d+) restart=(\d+) event=(\w+) t=([\d.]+)(?: step=(-?\d+))?")
# Environment of the shell this runs from that would change the job.
FOREIGN = ("MS_ENABLE_TFT", "MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID",
           "MS_TFT_PORT", "MS_TFT_IP", "RANK_ID", "RANK_SIZE", "DEVICE_ID", "MINDFT_RESTART_COUNT",
           "MINDFT_INSECURE", "MINDFT_KEY_FILE", "MINDFT_STATE_DIR", "MINDFT_BACKEND")
RESTART_POINTS = ("created", "imported", "initialized", "built", "ready")
PHASES = (("detect, kill, start", "fault", "created"), ("interpreter + imports", "created", "imported"),
          ("init() (cluster)", "imported", "initialized"), ("data + model", "initialized", "built"),
          ("restore / load", "built", "ready"), ("first step", "ready", "first_step"))
KINDS = {"a": "in-place rollback", "b": "restart, agent memory", "c": "kill all + checkpoint"}


def clean_env(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(changes)
    return env


def job_args(args: argparse.Namespace) -> list[str]:
    return ["--epochs", str(args.epochs), "--step-seconds", str(args.step_seconds), "--fault-step",
            str(args.fault_step), "--fault-rank", "1", "--timeline"]


def timeline(text: str) -> list[dict]:
    return [{"rank": int(m[1]), "restart": int(m[2]), "event": m[3], "t": float(m[4]),
             "step": None if m[5] is None else int(m[5])} for m in TIMELINE.finditer(text)]


def analyse(events: list[dict], fault_step: int, resumed_after: int, restarted: bool) -> dict:
    """Fault → resumed, the phases in between (slowest rank at each point) and the steps replayed."""
    faults = [e for e in events if e["event"] == "fault"]
    if len(faults) != 1 or faults[0]["step"] != fault_step:
        raise RuntimeError(f"expected one fault in step {fault_step}, the ranks logged {faults}")
    points = {"fault": faults[0]["t"]}
    after = [e for e in events if e["event"] == "step" and e["t"] > points["fault"]]
    for name, step in (("first_step", resumed_after + 1), ("caught_up", fault_step)):
        ends = [min((e["t"] for e in after if e["rank"] == r and e["step"] == step), default=None)
                for r in range(WORLD)]
        if None in ends:
            raise RuntimeError(f"a rank did not finish step {step} after the fault")
        points[name] = max(ends)
    phases = {}
    if restarted:
        for name in RESTART_POINTS:
            times = [e["t"] for e in events if e["event"] == name and e["restart"] == 1]
            if len(times) != WORLD:
                raise RuntimeError(f"restarted ranks logged {name!r} {len(times)} times, expected {WORLD}")
            points[name] = max(times)
        phases = {label: points[end] - points[start] for label, start, end in PHASES}
    return {"fault_to_resumed_s": points["first_step"] - points["fault"],
            "fault_to_caught_up_s": points["caught_up"] - points["fault"],
            "resumed_after": resumed_after, "steps_replayed": fault_step - resumed_after,
            "steps_lost": fault_step - resumed_after - 1, "phases_s": phases}


# ---- (a) and (b): mindft-launch ----------------------------------------------------------------

def run_mindft(kind: str, args: argparse.Namespace, run_dir: Path) -> dict:
    port = free_port_pair()
    argv = [sys.executable, "-m", "mindft.cli.launch", "--worker_num", str(WORLD), "--local_worker_num", str(WORLD),
            "--master_port", str(port), "--run-dir", str(run_dir), "--cluster_time_out", "120",
            str(SCRIPT), "--loop", *job_args(args), "--fault-kind", "uce-after" if kind == "a" else "exit",
            "--out", str(run_dir / "out")]
    env = clean_env(MS_ENABLE_TFT="{RSC:1}", MINDFT_RESET_FILE=str(run_dir / "reset.json"),
                    MINDFT_DUMP_DIR=str(run_dir / "dump"))
    run_dir.mkdir(parents=True)
    output = run_dir / "launcher.out"
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
        raise RuntimeError(f"({kind}) mindft-launch exit {code}, see {output}:\n{text[-3000:]}")
    restarted = len(re.findall(r"started rank \d+ \(pid \d+, restart [1-9]", text))
    if kind == "a" and (restarted or "restarting every worker" in text):
        raise RuntimeError(f"(a) a worker was restarted: not an in-place rollback, see {output}")
    if kind == "b" and ("restarting every worker from the node agents' memory" not in text or restarted != WORLD):
        raise RuntimeError(f"(b) not the restart-every-worker rung ({restarted} restarts), see {output}")
    done = re.search(r"recovery 1 done in ([\d.]+) s: .*; resumed after step (\d+)", text)
    phases = re.search(r"recovery phases: (\{.*\})", text)
    if not done or not phases:
        raise RuntimeError(f"({kind}) no 'recovery 1 done' / 'recovery phases' line, see {output}")
    row = analyse(timeline(text), args.fault_step, int(done[2]), restarted=kind == "b")
    row.update(kind=kind, controller_recovery_s=float(done[1]), controller_phases_s=ast.literal_eval(phases[1]))
    return row


# ---- (c): what TaskD does, played by this file ----------------------------------------------------

def checkpoint_parser() -> argparse.ArgumentParser:
    """The options of one rank of the unprotected job: every one examples/train_dp.py's build and
    fault drill read, and the checkpoints'."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-kind", default="exit")
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--checkpoint-every", type=int, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--resume-step", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.set_defaults(mindspore_tft=False)  # a job without mindft: no TrainFaultTolerance in it
    return parser


def checkpoint_worker(argv: list[str]) -> None:
    """One rank of the unprotected job: checkpoints to disk every N steps, resumes from one if told."""
    parser = checkpoint_parser()
    args = parser.parse_args(argv)
    # Not bench/ on the path: MindSpore's save_checkpoint imports a module named mindio if it
    # can, and bench/mindio.py is one.
    sys.path[:] = [str(SCRIPT.parent), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent)]
    import mindspore as ms
    from mindspore.communication import get_rank, init

    import train_dp  # the same data, model, step and fault drill as (a) and (b)
    line = train_dp.Timeline(args.timeline)
    line.started()

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.set_deterministic(True)
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(args.seed)
    line("initialized")
    dataset, net, optimizer = train_dp.build(args)
    net.register_forward_pre_hook(train_dp.fault_drill(args, optimizer, line))
    train_step = train_dp.loop_step(net, optimizer)
    batches = list(dataset.create_tuple_iterator(num_epochs=1))
    line("built")
    rank, own = get_rank(), args.checkpoint_dir / f"rank{get_rank()}"
    state = {p.name: p for p in (*net.get_parameters(), *optimizer.get_parameters())}
    if args.resume_step:
        loaded = ms.load_checkpoint(str(own / f"step{args.resume_step}.ckpt"))
        for name, parameter in state.items():
            parameter.set_data(loaded[name])
    line("ready", args.resume_step)
    own.mkdir(parents=True, exist_ok=True)
    for step in range(args.resume_step + 1, args.epochs * len(batches) + 1):
        train_step(*batches[(step - 1) % len(batches)])
        line("step", step)
        if step % args.checkpoint_every == 0:
            partial = own / f"partial-{step}.ckpt"  # a rank killed mid-write leaves no step*.ckpt
            ms.save_checkpoint([{"name": n, "data": p} for n, p in state.items()], str(partial))
            partial.rename(own / f"step{step}.ckpt")
    if args.out:
        train_dp.save_weights(args.out, rank, net, optimizer)


def run_checkpoint(args: argparse.Namespace, run_dir: Path) -> dict:
    """The agent: start the scheduler and every worker; on a worker's failure kill them all at
    once, then start them again from the newest checkpoint every rank wrote."""
    port = free_port()
    logs, checkpoints = run_dir / "logs", run_dir / "checkpoints"
    logs.mkdir(parents=True)
    cluster = {"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(port), "MS_WORKER_NUM": str(WORLD),
               "MS_TOPO_TIMEOUT": "120", "RANK_SIZE": str(WORLD)}
    processes: list[subprocess.Popen] = []

    def start(restart: int, resume_step: int) -> tuple[subprocess.Popen, list[subprocess.Popen]]:
        with open(logs / "scheduler.log", "ab") as log:
            scheduler = subprocess.Popen([sys.executable, *SCHEDULER_COMMAND], stdout=log, stderr=subprocess.STDOUT,
                                         env=clean_env(**cluster, MS_ROLE="MS_SCHED", RANK_ID="0"),
                                         start_new_session=True)
        workers = []
        for rank in range(WORLD):
            with open(logs / f"rank_{rank}.log", "ab") as log:
                workers.append(subprocess.Popen(
                    [sys.executable, __file__, "--checkpoint-worker", *job_args(args), "--fault-kind", "exit",
                     "--checkpoint-every", str(args.checkpoint_every), "--checkpoint-dir", str(checkpoints),
                     "--resume-step", str(resume_step), "--out", str(run_dir / "out")],
                    env=clean_env(**cluster, MS_ROLE="MS_WORKER", MS_NODE_ID=str(rank), RANK_ID=str(rank),
                                  DEVICE_ID=str(rank), LOCAL_RANK=str(rank), MINDFT_RESTART_COUNT=str(restart)),
                    stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True))
        processes.extend([scheduler, *workers])
        return scheduler, workers

    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        scheduler, workers = start(0, 0)
        while not any(w.poll() not in (None, 0) for w in workers):  # poll every 5 ms: detection is instant
            if all(w.poll() == 0 for w in workers) or time.monotonic() > deadline:
                raise RuntimeError(f"(c) the fault did not happen; see {logs}")
            time.sleep(0.005)
        for process in (*workers, scheduler):  # TaskD: kill every worker (and the cluster with them)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for process in (*workers, scheduler):
            process.wait()
        if sorted(w.returncode for w in workers) != [-signal.SIGKILL, 137]:
            raise RuntimeError(f"(c) expected one rank to exit 137 (the fault), got "
                               f"{[w.returncode for w in workers]}; see {logs}")
        held = [{int(p.name[4:-5]) for p in (checkpoints / f"rank{r}").glob("step*.ckpt")} for r in range(WORLD)]
        resume_step = max(set.intersection(*held), default=0)
        scheduler, workers = start(1, resume_step)
        for worker in workers:
            if worker.wait(max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"(c) restarted rank exit {worker.returncode}; see {logs}")
        scheduler.wait(30)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    text = "".join((logs / f"rank_{r}.log").read_text(errors="replace") for r in range(WORLD))
    row = analyse(timeline(text), args.fault_step, resume_step, restarted=True)
    row.update(kind="c", checkpoint_every=args.checkpoint_every)
    return row


# ---- the table -------------------------------------------------------------------------------

def same_weights(runs: dict[str, Path]) -> bool:
    """Every run's final parameters and optimizer state, rank by rank, are the same bytes."""
    import numpy as np

    def load(out: Path, rank: int) -> dict[str, bytes]:
        with np.load(out / f"rank{rank}.npz") as data:
            return {name: data[name].tobytes() for name in data.files}
    first, *others = runs.values()
    return all(load(first, rank) == load(out, rank) for out in others for rank in range(WORLD))


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """median, and (min–max) when repeated."""
    values = [v * scale for v in values]
    text = f"{statistics.median(values):.{digits}f}"
    return text if len(values) == 1 else f"{text} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def print_table(rows: dict[str, list[dict]]) -> None:
    kinds = list(rows)
    width = 30
    print(f"{'':<32}" + "".join(f"{'(' + k + ') ' + KINDS[k]:>{width}}" for k in kinds))

    def line(label: str, pick, scale: float = 1.0, digits: int = 2) -> None:
        cells = []
        for k in kinds:
            values = [pick(r) for r in rows[k]]
            cells.append("—" if None in values else spread(values, scale, digits))
        print(f"{label:<32}" + "".join(f"{c:>{width}}" for c in cells))

    line("fault → resumed, s", lambda r: r["fault_to_resumed_s"], digits=3)
    line("fault → faulted step redone, s", lambda r: r["fault_to_caught_up_s"], digits=3)
    line("steps replayed", lambda r: r["steps_replayed"], digits=0)
    line("steps lost beyond rollback", lambda r: r["steps_lost"], digits=0)
    for label, _, _ in PHASES:
        line(f"  {label}, s", lambda r, label=label: r["phases_s"].get(label), digits=3)
    line("controller: recovery, s", lambda r: r.get("controller_recovery_s"), digits=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round instead of --rounds")
    parser.add_argument("--rounds", type=int, default=3, help="(a), (b), (c) interleaved this many times")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="(c): save_checkpoint every N steps")
    parser.add_argument("--fault-step", type=int, default=15, help="the step the fault hits (of 32)")
    parser.add_argument("--step-seconds", type=float, default=0.1, help="sleep per step, standing in for compute")
    parser.add_argument("--epochs", type=int, default=2, help="16 steps per epoch")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, help="keep each run's directory (logs, launcher output) under KEEP")
    args = parser.parse_args()
    if not 1 < args.fault_step <= 16 * args.epochs:
        parser.error(f"--fault-step {args.fault_step}: must be in 2..{16 * args.epochs} (steps of the job)")
    if args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every {args.checkpoint_every}: must be at least 1")

    import tempfile
    rounds = 1 if args.quick else args.rounds
    rows: dict[str, list[dict]] = {"a": [], "b": [], "c": []}
    identical = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mindft-bench-recovery-") as scratch:
        tmp = args.keep or scratch
        for index in range(rounds):
            outs = {}
            for kind in rows:
                run_dir = Path(tmp) / f"{kind}{index}"
                started = time.monotonic()
                row = run_mindft(kind, args, run_dir) if kind != "c" else run_checkpoint(args, run_dir)
                row["load_after"] = os.getloadavg()[0]
                rows[kind].append(row)
                outs[kind] = run_dir / "out"
                print(f"  round {index + 1}/{rounds} ({kind}) fault → resumed {row['fault_to_resumed_s']:.3f} s, "
                      f"resumed after step {row['resumed_after']}, job {time.monotonic() - started:.0f} s, "
                      f"load {row['load_after']:.1f}", flush=True)
            identical.append(same_weights(outs))
    load_after = os.getloadavg()
    ratio = {name: [c["fault_to_resumed_s"] / o["fault_to_resumed_s"] for c, o in zip(rows["c"], rows[other])]
             for name, other in (("c/b", "b"), ("c/a", "a"))}
    ratio_caught = [c["fault_to_caught_up_s"] / b["fault_to_caught_up_s"] for c, b in zip(rows["c"], rows["b"])]
    print()
    print(f"{WORLD} ranks, CPU, MCCL all-reduce; {16 * args.epochs} steps of ~{args.step_seconds} s + compute; fault "
          f"in step {args.fault_step}; (c) checkpoints every {args.checkpoint_every} steps; {rounds} round(s), "
          f"median (min–max); load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print_table(rows)
    print(f"ratio (c)/(b), fault → resumed: {spread(ratio['c/b'])}; fault → faulted step redone: "
          f"{spread(ratio_caught)}")
    print(f"ratio (c)/(a), fault → resumed: {spread(ratio['c/a'], digits=0)}")
    print(f"final weights bit-identical across (a), (b), (c): {'yes' if all(identical) else 'NO'}")
    met = statistics.median(ratio["c/b"]) >= TARGET and all(r["steps_lost"] == 0 for r in rows["b"])
    print(f"target: (b) at least {TARGET:.0f}x faster than (c) with no step lost beyond the rollback: "
          f"{'met' if met else 'NOT met'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "recovery", "config": {"ranks": WORLD, "epochs": args.epochs, "step_seconds": args.step_seconds,
                                            "fault_step": args.fault_step, "checkpoint_every": args.checkpoint_every,
                                            "rounds": rounds},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_before": load_before,
                    "loadavg_after": load_after},
        "rows": rows, "ratios": {"c/b": ratio["c/b"], "c/a": ratio["c/a"], "c/b_caught_up": ratio_caught},
        "weights_identical": identical, "target": {"c_over_b": TARGET, "met": met}}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--checkpoint-worker"]:  # a rank of (c), started by run_checkpoint
        checkpoint_worker(sys.argv[2:])
    else:
        main()
