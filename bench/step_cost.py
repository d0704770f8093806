"""What mindft costs a training step: time in its per-step calls, against the same loop without it.

N real rank processes on this machine run the same loop: a fixed compute stand-in per step
(a single-threaded numpy matmul repeated to take about ``--work-ms``; numpy releases the GIL,
as MindSpore does while the device works), then the mindft calls of one step. Three variants,
side by side in one run:

* ``none``: the loop without mindft (the reference for the slowdown);
* ``mindft``: this tree: a real Controller (a thread of a driver process) on 127.0.0.1 and
  one Processor per rank, joined and finished through the rank engine's loop
  (``mindft.rank.loop.RankLoop``); per step the calls of its ``end_step``, timed one by one:
  ``wait_window`` (the follower's answer, and the wait for the window when it is closed),
  ``finished`` (fire and forget) and ``poll_action``;
* ``old``: mindft at ``--old`` (default commit 6a49249, exported with ``git archive`` and run
  with PYTHONPATH pointing at it): ``step_begin`` and the synchronous ``step_end`` commit.

Each rank times its mindft calls with perf_counter. The slowdown is the median rank's wall
time per step over the ``none`` variant's; CPU per step counts every thread of the rank
process (the processor's I/O thread included), and the controller's thread is timed apart.
Every run registers first and starts the loop on one signal, so all ranks start together.

    python bench/step_cost.py                    # 2, 4, 8, 16 ranks (about 2 minutes on 2 cores)
    python bench/step_cost.py --quick            # 2 and 4 ranks, fewer steps (about 30 s)
    python bench/step_cost.py --insecure         # CurveZMQ off
    python bench/step_cost.py --old none         # skip the old implementation
Writes bench/results/step_cost.json.
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
import threading
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "step_cost.json"
OLD_REF = "6a49249"  # the last commit with the per-step commit barrier
TARGET_US = 20.0
VARIANTS = ("none", "mindft", "old")
# One BLAS thread per rank: N ranks share the cores like N training processes share devices.
SINGLE_THREAD = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
MATRIX = 96  # one matmul of this size is a fraction of a millisecond; repeated to reach --work-ms
HEARTBEAT = ("0.5", "20")  # interval, misses: a loaded 2-core box must not declare ranks dead
RUN_TIMEOUT = 300.0
WARMUP_FRACTION = 0.1


# ---- one rank ---------------------------------------------------------------------------------

class Compute:
    """The compute stand-in: ``reps`` single-threaded matmuls."""

    def __init__(self, reps: int) -> None:
        import numpy
        generator = numpy.random.default_rng(0)
        self.a = generator.random((MATRIX, MATRIX))
        self.b = generator.random((MATRIX, MATRIX))
        self.reps = reps

    def __call__(self) -> None:
        a, b = self.a, self.b
        for _ in range(self.reps):
            a @ b


class QuietHooks:
    """RankHooks for a loop that injects no faults: any action means the measurement is void."""

    def settle(self) -> tuple[int, ...]:
        raise RuntimeError("unexpected PAUSE: the benchmark injects no faults")

    def restore(self, step: int) -> tuple[int, ...]:
        raise RuntimeError("unexpected ROLLBACK")

    def resume(self, step: int) -> None:
        raise RuntimeError("unexpected RESUME")

    def arm(self, fault: Any, detail: str) -> None:
        raise RuntimeError("unexpected INJECT_FAULT")

    def dump_and_exit(self, step: int, reason: str) -> Any:
        raise RuntimeError(f"the controller ended the job: {reason}")


def rank_main(variant: str, steps: int, reps: int) -> None:
    """One rank: set up, say ready, wait for go, run ``steps`` steps, print one JSON line, wait for
    end, leave."""
    compute = Compute(reps)
    processor = loop = None
    if variant == "mindft":
        from mindft.config import load_config
        from mindft.rank.processor import Processor
        from mindft.rank.loop import RankLoop
        config = load_config()
        processor = Processor(config, f"bench://{config.rank}")
        loop = RankLoop(processor, QuietHooks())
        loop.register((0,))
    elif variant == "old":
        from mindft.config import load_config
        from mindft.rank.processor import Processor
        config = load_config()
        processor = Processor(config, f"bench://{config.rank}")
        processor.register(held_steps=(0,))
    compute()  # numpy's first call allocates; keep it out of the loop
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go from the driver")
    perf_counter = time.perf_counter
    costs: list[float] = []
    calls: dict[str, list[float]] = {"wait_window": [], "finished": [], "poll_action": [],
                                     "step_begin": [], "step_end": []}
    waited: list[int] = []  # per step: 1 when the window was closed and wait_window blocked
    cpu_start, wall_start = time.process_time(), perf_counter()
    if variant == "none":
        for _ in range(steps):
            compute()
            costs.append(0.0)
    elif variant == "mindft":
        end_of_step = processor.follower.end_of_step
        wait_window, finished, poll_action = processor.wait_window, processor.finished, processor.poll_action
        for step in range(1, steps + 1):
            compute()
            t0 = perf_counter()
            will_wait = end_of_step(step).await_window
            action = wait_window(step) if will_wait else None
            t1 = perf_counter()
            # (the snapshot of ``step`` would be captured here)
            finished(step)
            t2 = perf_counter()
            action = action or poll_action()
            t3 = perf_counter()
            if action is not None:
                raise RuntimeError(f"unexpected {action.kind.name} at step {step}")
            waited.append(will_wait)
            costs.append(t3 - t0)
            calls["wait_window"].append(t1 - t0)
            calls["finished"].append(t2 - t1)
            calls["poll_action"].append(t3 - t2)
    else:
        step_begin, step_end = processor.step_begin, processor.step_end
        for step in range(1, steps + 1):
            t0 = perf_counter()
            step_begin(step)
            t1 = perf_counter()
            compute()
            t2 = perf_counter()
            action = step_end(step)
            t3 = perf_counter()
            if action is not None:
                raise RuntimeError(f"unexpected {action.kind.name} at step {step}")
            costs.append((t1 - t0) + (t3 - t2))
            calls["step_begin"].append(t1 - t0)
            calls["step_end"].append(t3 - t2)
    wall, cpu = perf_counter() - wall_start, time.process_time() - cpu_start
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "waited": waited or [0] * steps,
                      "costs_us": [round(c * 1e6, 2) for c in costs],
                      "calls_us": {name: [round(c * 1e6, 2) for c in values] for name, values in calls.items() if values}}),
          flush=True)
    # The driver reads the controller's CPU clock before any rank's Done can end the job.
    if sys.stdin.readline().strip() != "end":
        raise SystemExit("no end from the driver")
    if variant == "mindft":
        if loop.finish(steps) is not None:
            raise RuntimeError("a recovery after Done; the benchmark triggers none")
        processor.close()
    elif variant == "old":
        processor.done(steps)
        processor.close()


# ---- one run of N ranks (the driver, a process of its own per variant) -------------------------

def reap(procs: list[subprocess.Popen]) -> None:
    """Kill and wait for whatever a run left running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def driver_main(variant: str, n: int, steps: int, reps: int, secure: bool, snapshot_every: int) -> None:
    """Run ``n`` ranks of ``variant`` (with a controller unless ``none``); print one JSON line."""
    import logging
    logging.basicConfig(level=logging.ERROR)
    env = dict(os.environ, **SINGLE_THREAD, MS_WORKER_NUM=str(n), MINDFT_HEARTBEAT_INTERVAL=HEARTBEAT[0],
               MINDFT_HEARTBEAT_MISSES=HEARTBEAT[1], MINDFT_SNAPSHOT_EVERY=str(snapshot_every))
    env.pop("MINDFT_INSECURE", None)
    controller = thread = None
    with tempfile.TemporaryDirectory() as tmp:
        if variant != "none":
            from mindft.config import MindftConfig, Timeouts
            from mindft.controller import Controller
            from mindft.net.keys import generate_keys
            key_file = None
            if secure:
                key_file = Path(tmp) / "bench.key"
                generate_keys(key_file)
                env["MINDFT_KEY_FILE"] = str(key_file)
            else:
                env["MINDFT_INSECURE"] = "1"
            timeouts = Timeouts(heartbeat_interval=float(HEARTBEAT[0]), heartbeat_misses=int(HEARTBEAT[1]))
            extra = {"snapshot_every": snapshot_every} if variant == "mindft" else {}
            controller = Controller(MindftConfig(world_size=n, controller_port=0, insecure=not secure,
                                                 key_file=key_file, timeouts=timeouts, **extra))
            thread = controller.start()
            env["MS_TFT_PORT"] = controller.endpoint.rsplit(":", 1)[1]
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(n)]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", variant, str(steps), str(reps)],
                                  env=dict(env, MS_NODE_ID=str(r)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=logs[r], text=True) for r in range(n)]
        watchdog = threading.Timer(RUN_TIMEOUT, reap, (procs,))
        watchdog.start()
        try:
            for rank, proc in enumerate(procs):
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"rank {rank} did not get ready: {tail(logs[rank])}")
            clock = time.pthread_getcpuclockid(thread.ident) if thread is not None else None
            controller_cpu = time.clock_gettime(clock) if clock is not None else 0.0
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            ranks = []
            for rank, proc in enumerate(procs):
                line = proc.stdout.readline()
                if not line.startswith("{"):
                    raise RuntimeError(f"rank {rank} failed: {tail(logs[rank])}")
                ranks.append(json.loads(line))
            if clock is not None:
                controller_cpu = time.clock_gettime(clock) - controller_cpu
            for proc in procs:
                proc.stdin.write("end\n")
                proc.stdin.flush()
            for rank, proc in enumerate(procs):
                if proc.wait(60) != 0:
                    raise RuntimeError(f"rank {rank} exited with {proc.returncode}: {tail(logs[rank])}")
            if controller is not None:
                result = controller.join(60)
                if result is None or result.exit_code != 0:
                    raise RuntimeError(f"controller did not finish cleanly: {result}")
        finally:
            watchdog.cancel()
            reap(procs)
            if controller is not None:
                controller.stop()
            for handle in logs:
                handle.close()
    print(json.dumps(summarize(variant, n, steps, ranks, controller_cpu)), flush=True)


def tail(handle: Any, size: int = 1500) -> str:
    handle.flush()
    handle.seek(0)
    return handle.read()[-size:] or "(no output)"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summarize(variant: str, n: int, steps: int, ranks: list[dict], controller_cpu: float) -> dict:
    skip = max(1, int(WARMUP_FRACTION * steps))
    costs = [c for r in ranks for c in r["costs_us"][skip:]]
    open_costs = [c for r in ranks for c, w in zip(r["costs_us"][skip:], r["waited"][skip:]) if not w]
    calls = {name: statistics.median(c for r in ranks for c in r["calls_us"][name][skip:])
             for name in ranks[0]["calls_us"]}
    return {"variant": variant, "ranks": n, "steps": steps,
            "mindft_median_us": statistics.median(costs), "mindft_p99_us": percentile(costs, 0.99),
            "mindft_mean_us": statistics.fmean(costs), "call_median_us": calls,
            "open_window_median_us": statistics.median(open_costs) if open_costs else None,
            "open_window_p99_us": percentile(open_costs, 0.99) if open_costs else None,
            "window_waits": 1 - len(open_costs) / len(costs),
            "step_wall_us": statistics.median(r["wall_s"] / steps * 1e6 for r in ranks),
            "step_cpu_us": statistics.median(r["cpu_s"] / steps * 1e6 for r in ranks),
            "controller_cpu_per_step_us": controller_cpu / steps * 1e6}


# ---- where the time of one call goes (--breakdown) ----------------------------------------------

def breakdown(reps: int, steps: int) -> dict[str, tuple[float, float]]:
    """Median and p99 (µs) of each part of the per-step calls, each timed right after a compute step.

    In one process, against a ROUTER that is never read (libzmq queues the frames without Python):
    what the training thread pays, and what it would pay with the alternatives named in the output.
    """
    import zmq
    from mindft.net import channel
    from mindft.config import MindftConfig
    from mindft.rank.processor import Processor
    from mindft.protocol import StepReport, encode
    compute = Compute(reps)
    context = zmq.Context()
    router = channel.router(context, None, "tcp://127.0.0.1:*")
    port = int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    processor = Processor(MindftConfig(rank=0, world_size=1, controller_port=port, insecure=True))
    follower = processor.follower
    report = StepReport(0, 1)
    template = encode(StepReport(123456789, 987654321)).replace(b"123456789", b"%d").replace(b"987654321", b"%d")
    assert template % (0, 1) == encode(report)

    def pair(reader: bool) -> tuple[zmq.Socket, Any]:
        address = f"inproc://step-cost-{reader}"
        inbound, outbound = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        for sock in (inbound, outbound):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        inbound.bind(address)
        outbound.connect(address)
        stop = threading.Event()

        def drain() -> None:  # what the processor's I/O thread does with each frame, minus the forwarding
            poller = zmq.Poller()
            poller.register(inbound, zmq.POLLIN)
            while not stop.is_set():
                if poller.poll(100):
                    while True:
                        try:
                            inbound.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
        thread = threading.Thread(target=drain, daemon=True) if reader else None
        if thread is not None:
            thread.start()

        def close() -> None:
            stop.set()
            if thread is not None:
                thread.join()
            inbound.close(0)
            outbound.close(0)
        return outbound, close

    quiet, close_quiet = pair(False)
    woken, close_woken = pair(True)
    own = channel.dealer(context, None, f"tcp://127.0.0.1:{port}", b"training-thread")
    frame = b"M" + encode(report)
    counter = iter(range(10**9))

    def next_step() -> int:
        step = next(counter) + 1
        follower.on_progress(step)  # as if Progress arrived: the open window's fast path
        return step

    parts: dict[str, Any] = {
        "Follower.finished (a StepReport value)": lambda step: follower.finished(step),
        "protocol.encode(StepReport)": lambda step: encode(report),
        "byte template % (rank, step) [alternative]": lambda step: template % (0, step),
        "inproc send, nobody woken": lambda step: quiet.send(frame, zmq.NOBLOCK),
        "inproc send waking a polling thread": lambda step: woken.send(frame, zmq.NOBLOCK),
        "tcp send on the training thread's own DEALER [alternative]": lambda step: own.send(frame[1:], zmq.NOBLOCK),
        "Processor.finished": processor.finished,
        "Processor.wait_window (window open)": processor.wait_window,
        "Processor.poll_action": lambda step: processor.poll_action(),
    }
    results = {}
    perf_counter = time.perf_counter
    try:
        for name, call in parts.items():
            times = []
            for _ in range(steps):
                step = next_step()
                compute()
                started = perf_counter()
                call(step)
                times.append(perf_counter() - started)
            times = times[int(WARMUP_FRACTION * steps):]
            results[name] = (statistics.median(times) * 1e6, percentile(times, 0.99) * 1e6)
    finally:
        close_quiet()
        close_woken()
        own.close(0)
        processor.close()
        router.close(0)
        context.term()
    return results


# ---- the whole comparison -----------------------------------------------------------------------

def calibrate(work_ms: float) -> int:
    """Repetitions of the stand-in matmul that take about ``work_ms`` on one core."""
    compute = Compute(1)
    compute()
    runs = 200
    started = time.perf_counter()
    for _ in range(runs):
        compute()
    one = (time.perf_counter() - started) / runs
    return max(1, round(work_ms / 1e3 / one))


def export_old(ref: str, into: Path) -> Optional[str]:
    """``git archive`` the mindft package at ``ref`` into ``into``; the reason if that fails."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "mindft"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        return f"cannot export mindft at {ref!r} from {REPO}: {error} {detail.decode(errors='replace').strip()}"
    return None


def run_driver(variant: str, n: int, args: argparse.Namespace, reps: int, tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, __file__, "--driver", variant, str(n), str(args.steps), str(reps),
               "insecure" if args.insecure else "secure", str(args.snapshot_every)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT + 120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} with {n} ranks failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def print_table(rows: list[dict]) -> None:
    base = {r["ranks"]: r for r in rows if r["variant"] == "none"}
    print(f"{'ranks':>5} {'variant':<7} {'median µs':>9} {'p99 µs':>9} {'mean µs':>9} {'open med':>8} {'open p99':>8} "
          f"{'calls (median µs)':<44} "
          f"{'waits':>6} {'step µs':>8} {'cpu/step':>8} {'+cpu µs':>8} {'ctl µs':>7} {'slowdown':>8}")
    for row in rows:
        ref = base.get(row["ranks"])
        calls = " ".join(f"{name}={value:.1f}" for name, value in row["call_median_us"].items())
        extra_cpu = f"{row['step_cpu_us'] - ref['step_cpu_us']:8.1f}" if ref else f"{'':>8}"
        slowdown = f"{row['step_wall_us'] / ref['step_wall_us']:8.3f}" if ref else f"{'':>8}"
        print(f"{row['ranks']:>5} {row['variant']:<7} {row['mindft_median_us']:>9.1f} {row['mindft_p99_us']:>9.1f} "
              f"{row['mindft_mean_us']:>9.1f} {number(row['open_window_median_us'])} "
              f"{number(row['open_window_p99_us'])} {calls:<44} {row['window_waits']:>6.1%} {row['step_wall_us']:>8.0f} "
              f"{row['step_cpu_us']:>8.0f} {extra_cpu} {row['controller_cpu_per_step_us']:>7.1f} {slowdown}")


def number(value: Optional[float], width: int = 8) -> str:
    return f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, fewer steps (about 30 s)")
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts (default 2 4 8 16; --quick: 2 4)")
    parser.add_argument("--steps", type=int, help="steps per rank (default 800; --quick: 200)")
    parser.add_argument("--work-ms", type=float, default=1.0, help="compute stand-in per step (default 1 ms)")
    parser.add_argument("--insecure", action="store_true", help="CurveZMQ off (default: on)")
    parser.add_argument("--snapshot-every", type=int, default=1, help="MINDFT_SNAPSHOT_EVERY (default 1)")
    parser.add_argument("--old", default=OLD_REF, metavar="REF|PATH|none",
                        help=f"the old implementation: a git ref (default {OLD_REF}), a source tree, or none")
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"JSON file (default {RESULTS})")
    parser.add_argument("--breakdown", action="store_true",
                        help="time each part of the per-step calls in this process instead")
    parser.add_argument("--rank", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--driver", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        variant, steps, reps = args.rank
        rank_main(variant, int(steps), int(reps))
        return
    if args.driver:
        variant, n, steps, reps, security, every = args.driver
        driver_main(variant, int(n), int(steps), int(reps), security == "secure", int(every))
        return
    sizes = args.ranks or ([2, 4] if args.quick else [2, 4, 8, 16])
    args.steps = args.steps or (200 if args.quick else 800)
    for name, value, low in (("--ranks", min(sizes), 1), ("--steps", args.steps, 20), ("--work-ms", args.work_ms, 0),
                             ("--snapshot-every", args.snapshot_every, 1)):
        if value < low or (name == "--work-ms" and value <= 0):
            parser.error(f"{name} must be {'> 0' if name == '--work-ms' else f'>= {low}'}, got {value}")
    os.environ.update(SINGLE_THREAD)
    reps = calibrate(args.work_ms)
    if args.breakdown:
        import logging
        logging.basicConfig(level=logging.ERROR)
        print(f"each part timed right after a {args.work_ms:g} ms compute step, {args.steps} times "
              f"(median / p99 µs):")
        for name, (median, p99) in breakdown(reps, args.steps).items():
            print(f"  {name:<60} {median:8.1f} {p99:9.1f}")
        return
    rows: list[dict] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree: Optional[Path] = None
        old_note = "skipped (--old none)"
        if args.old != "none":
            if Path(args.old).is_dir():
                old_tree, old_note = Path(args.old).resolve(), f"source tree {Path(args.old).resolve()}"
            else:
                failure = export_old(args.old, Path(tmp))
                old_tree, old_note = (None, failure) if failure else (Path(tmp), f"git ref {args.old}")
            if old_tree is None:
                print(f"old implementation skipped: {old_note}", flush=True)
        variants = [v for v in VARIANTS if v != "old" or old_tree is not None]
        for n in sizes:
            for variant in variants:
                tree = old_tree if variant == "old" else REPO
                rows.append(run_driver(variant, n, args, reps, tree))
                row = rows[-1]
                print(f"  {variant:<6} n={n:<3} mindft median {row['mindft_median_us']:8.1f} µs  "
                      f"p99 {row['mindft_p99_us']:9.1f} µs  step {row['step_wall_us']:8.0f} µs", flush=True)
    print()
    print(f"per step per rank: {args.steps} steps ({int(WARMUP_FRACTION * 100)}% warm-up left out), compute "
          f"{args.work_ms:g} ms ({reps} × matmul {MATRIX}²), CurveZMQ {'off' if args.insecure else 'on'}, "
          f"snapshot every {args.snapshot_every}; old = {old_note}")
    print_table(rows)
    ours = [r for r in rows if r["variant"] == "mindft"]
    verdict = {"target_us": TARGET_US, "median_met": all(r["mindft_median_us"] <= TARGET_US for r in ours),
               "worst_median_us": max(r["mindft_median_us"] for r in ours)}
    print(f"target: median ≤ {TARGET_US:g} µs per step at every size: "
          f"{'met' if verdict['median_met'] else 'MISSED'} (worst {verdict['worst_median_us']:.1f} µs)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "step_cost",
        "metric": "per step per rank: µs in mindft calls (mindft: wait_window + finished + poll_action; "
                  "old: step_begin + step_end), measured in the rank; step wall and CPU (all threads of the "
                  "rank process) per step; controller thread CPU per step; slowdown = step wall / none's",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "config": {"steps": args.steps, "warmup_fraction": WARMUP_FRACTION, "work_ms": args.work_ms,
                   "matmul_reps": reps, "secure": not args.insecure, "snapshot_every": args.snapshot_every,
                   "old": old_note if old_tree is not None else None, "ranks": sizes},
        "rows": rows, "target": verdict}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
