"""What mindft costs a training step, and how fast it gets training going again after a rollback.

A ~25M-parameter MLP (Adam: ~100 MB of weights + ~200 MB of moments) trains in
MindSpore PyNative mode on CPU. Blocks of plain steps and of steps guarded by
``FaultTolerantLoop`` (a snapshot of every parameter and moment after EVERY step,
plus the FINISHED/COMMIT vote with a real controller process over ZeroMQ) alternate
in one run, so both see the same machine state; the overhead is the median over
rounds of the ratio of adjacent blocks' mean step times (robust to background load);
each block includes the wait for its last snapshot, so no copy escapes the timing. A third column copies synchronously (no overlap with the next
step's forward/backward pass) to show what the overlap buys, and a fourth snapshots
every N-th step only (a fixed ``MINDFT_SNAPSHOT_EVERY``). The budget column lets the
controller choose the cadence from the measured costs (``MINDFT_OVERHEAD_BUDGET``, default
1%): it runs in longer blocks (``--budget-steps``) next to plain blocks of the same length,
since it snapshots only every N-th step; its blocks are a whole number of N-step periods
(``--budget-steps`` rounded to a multiple of the N chosen), so each holds the same number of
snapshots and the median over rounds is not biased towards blocks without one.

MindSpore's own ``save_checkpoint`` of the same state (weights and Adam moments) runs side by
side: after every step, synchronously and with ``async_save=True`` (a thread writes; the data
is copied first), next to the plain blocks (``--ckpt-steps`` per block); and every N-th step
at the budget's N, next to the plain blocks of the budget's length. Checkpoints go to
``--ckpt-dir`` (default: a temporary directory on the disk under ``bench/results``), one
file overwritten; each block waits for its last asynchronous save.

Then a fault is raised inside a step: the time from ROLLBACK received to training
resumed (restore of ~300 MB into the live parameters, acks) is reported.

    python bench/train_overhead.py [--batch-sizes 64 256] [--rounds 8] [--steps 4] [--every 4] [--budget-steps 24]
                                   [--ckpt-steps 2] [--ckpt-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import free_port  # bench/ is the script's directory (imported before it leaves the path)

# Not bench/ on the path: MindSpore's save_checkpoint imports a module named mindio if it can,
# and bench/mindio.py is one.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import nn  # noqa: E402

from mindft.config import MindftConfig, TFTOptions, Timeouts  # noqa: E402
from mindft.rank.faults import DeviceFault  # noqa: E402
from mindft.flow.cadence import Schedule  # noqa: E402
from mindft.mindspore import FaultTolerantLoop  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "train_overhead.json"
WIDTH, IN_OUT = 4096, 1024  # 1024x4096 + 4096x4096 + 4096x1024 ≈ 25.2M parameters
TARGET = 1.03


def start_controller(port: int) -> subprocess.Popen:
    env = dict(os.environ, MS_TFT_PORT=str(port), MS_WORKER_NUM="1", MINDFT_INSECURE="1",
               MINDFT_LOG_LEVEL="WARNING")
    return subprocess.Popen([sys.executable, "-m", "mindft.controller"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def build() -> tuple[nn.Cell, nn.Optimizer, nn.Cell]:
    ms.set_seed(0)
    net = nn.SequentialCell(nn.Dense(IN_OUT, WIDTH), nn.ReLU(), nn.Dense(WIDTH, WIDTH), nn.ReLU(),
                            nn.Dense(WIDTH, IN_OUT))
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-4)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    step.set_train()
    return net, optimizer, step


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def wait_async_saves() -> None:
    """Wait for MindSpore's asynchronous save_checkpoint thread (it names it asyn_save_ckpt)."""
    for thread in threading.enumerate():
        if thread.name == "asyn_save_ckpt":
            thread.join()


# mode → (block length: "short" (--steps, or --ckpt-steps for checkpoints) or "long" (the
# budget's), the plain mode its ratio is taken against)
MODES = {"plain": ("short", None), "mindft": ("short", "plain"), "mindft_sync": ("short", "plain"),
         "mindft_sparse": ("short", "plain"), "ckpt_sync": ("ckpt", "plain_ckpt"),
         "ckpt_async": ("ckpt", "plain_ckpt"), "plain_ckpt": ("ckpt", None),
         "plain_long": ("long", None), "mindft_budget": ("long", "plain_long"),
         "ckpt_sync_budget": ("long", "plain_long"), "ckpt_async_budget": ("long", "plain_long")}


def measure(batch: int, rounds: int, steps: int, every: int, port: int, budget_steps: int, ckpt_steps: int,
            ckpt_dir: Path) -> dict:
    net, optimizer, train_step = build()
    params = sum(p.size for p in net.trainable_params())
    state_bytes = sum(p.asnumpy().nbytes for p in train_step.get_parameters())
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.random((batch, IN_OUT), dtype=np.float32))
    y = ms.Tensor(rng.random((batch, IN_OUT), dtype=np.float32))

    def run(xb: ms.Tensor, yb: ms.Tensor) -> None:
        train_step(xb, yb).asnumpy()  # asnumpy: wait for the step's kernels

    config = MindftConfig(tft=TFTOptions(uce=True), controller_port=port, insecure=True,
                          timeouts=Timeouts(heartbeat_interval=0.5))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    paired: dict[str, list[float]] = {mode: [] for mode, (_, against) in MODES.items() if against}
    # The same ratio in CPU time (every thread of the process: the copy thread too), which a
    # busy machine disturbs less than wall time.
    paired_cpu: dict[str, list[float]] = {mode: [] for mode in paired}
    ckpt_file = str(ckpt_dir / f"bench-b{batch}.ckpt")
    saved = [0]  # checkpoint-mode steps so far, for "every N-th step"

    def save(async_save: bool) -> None:
        ms.save_checkpoint(train_step, ckpt_file, async_save=async_save)
    load_before = load()
    with FaultTolerantLoop(net, optimizer, config) as loop:
        session = loop.session
        processor = session.processor
        # Bench-only: keep the cadence the controller announces for the budget blocks, and
        # put fixed cadences in place for the others.
        announced = [processor.follower.schedule]
        processor._set_cadence = lambda wire: wire and announced.__setitem__(0, Schedule.from_wire(wire))
        fixed = {"mindft": Schedule.fixed(1), "mindft_sync": Schedule.fixed(1), "mindft_sparse": Schedule.fixed(every)}
        for _ in range(3):  # warm-up: kernels, snapshot buffers, page faults
            run(x, y)
            loop.step(run, x, y)
        processor.follower.schedule = announced[0]
        for _ in range(2 * budget_steps):  # the controller learns the costs and picks the cadence
            loop.step(run, x, y)
            processor.follower.schedule = announced[0]
        budget_every = announced[0].segments[-1][1]
        # Whole N-step periods: every budget block then holds the same number of snapshots.
        long_steps = budget_every * max(1, round(budget_steps / budget_every))
        counts = {"short": steps, "ckpt": ckpt_steps, "long": long_steps}
        for _ in range(rounds):
            block: dict[str, float] = {}
            block_cpu: dict[str, float] = {}
            for mode, (length, _) in MODES.items():
                # Bench-only switches: overlap the copy or not, the cadence.
                session.overlap = mode != "mindft_sync"
                count = counts[length]
                session._step_exit = None  # the other modes' blocks in between are no step of this one
                start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(count):
                    if mode.startswith("plain"):
                        run(x, y)
                    elif mode.startswith("ckpt"):
                        run(x, y)
                        saved[0] += 1
                        if not mode.endswith("_budget") or saved[0] % budget_every == 0:
                            save(async_save="async" in mode)
                    else:
                        processor.follower.schedule = fixed.get(mode) or announced[0]
                        loop.step(run, x, y)
                session.store.wait()  # the block pays for its last capture too
                wait_async_saves()  # and for its last asynchronous checkpoint
                block[mode] = (time.perf_counter() - start) / count
                block_cpu[mode] = (time.process_time() - cpu_start) / count
                times[mode].append(block[mode])
            # Adjacent blocks see the same background load: their ratio cancels slow drift.
            for mode, (_, against) in MODES.items():
                if against:
                    paired[mode].append(block[mode] / block[against])
                    paired_cpu[mode].append(block_cpu[mode] / block_cpu[against])
        budget_every_end = announced[0].segments[-1][1]
        processor.follower.schedule = Schedule.fixed(1)
        session.overlap = True
        capture = timed(lambda: (session.store.capture(session.step, session.state.arrays()),
                                 session.store.wait()))

        # A fault inside the next step, after the optimizer update: the rollback must undo it.
        def faulty(xb: ms.Tensor, yb: ms.Tensor) -> None:
            run(xb, yb)
            raise DeviceFault(detail="bench")
        before = session.step
        fault_to_resumed = timed(loop.step, faulty, x, y)
        assert session.step == before, "the faulted step was not rolled back"
        rollback_to_resumed = session.last_recovery["rollback_to_resume_s"]
    plain, guarded, sync, sparse, budget = (statistics.median(times[k])
                                            for k in ("plain", "mindft", "mindft_sync", "mindft_sparse", "mindft_budget"))
    ckpt = {f"ratio_{mode}": [min(paired[mode]), statistics.median(paired[mode]), max(paired[mode])]
            for mode in ("ckpt_sync", "ckpt_async", "ckpt_sync_budget", "ckpt_async_budget")}
    cpu = {f"cpu_ratio_{mode}": [min(v), statistics.median(v), max(v)] for mode, v in paired_cpu.items()}
    return {**ckpt, **cpu, "ckpt_steps": ckpt_steps, "budget_block_steps": long_steps,
            "plain_long_ms": statistics.median(times["plain_long"]) * 1e3,
        "batch": batch, "parameters": params, "state_bytes": state_bytes,
        "steps_per_mode": len(times["plain"]) * steps,
        "plain_ms": plain * 1e3, "mindft_ms": guarded * 1e3, "mindft_sync_ms": sync * 1e3,
        "ratio": statistics.median(paired["mindft"]), "ratio_sync": statistics.median(paired["mindft_sync"]),
        "snapshot_every": every, "mindft_sparse_ms": sparse * 1e3,
        "ratio_sparse": statistics.median(paired["mindft_sparse"]),
        "capture_alone_ms": capture * 1e3,
        "rollback_to_resumed_ms": rollback_to_resumed * 1e3,
        "fault_to_resumed_ms": fault_to_resumed * 1e3,
        "budget_every": budget_every, "budget_every_end": budget_every_end, "budget_steps": budget_steps,
        "mindft_budget_ms": budget * 1e3,
        "ratio_budget": statistics.median(paired["mindft_budget"]),
        "ratio_budget_min": min(paired["mindft_budget"]), "ratio_budget_max": max(paired["mindft_budget"]),
        "ratio_min": min(paired["mindft"]), "ratio_max": max(paired["mindft"]),
        "load_before": load_before, "load_after": load(),
    }


def markdown(rows: list) -> str:
    """The README's table of one rank, from a run's rows."""
    def spread(values: list) -> str:
        return " / ".join(f"{v:.3f}" for v in values)
    lines = ["| batch | plain step | **budget: N** | **budget: ratio** | budget: CPU ratio | every step | every 4th step "
             "| `save_checkpoint` every step, sync | async | `save_checkpoint` every N, sync | async "
             "| load (1/5/15 min) before → after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['plain_ms']:.1f} ms | **{r['budget_every']}** | "
            f"**{spread([r['ratio_budget_min'], r['ratio_budget'], r['ratio_budget_max']])}** | "
            f"{spread(r['cpu_ratio_mindft_budget']) if 'cpu_ratio_mindft_budget' in r else '—'} | "
            f"{spread([r['ratio_min'], r['ratio'], r['ratio_max']])} | {r['ratio_sparse']:.3f} | "
            f"{spread(r['ratio_ckpt_sync'])} | {spread(r['ratio_ckpt_async'])} | "
            f"{spread(r['ratio_ckpt_sync_budget'])} | {spread(r['ratio_ckpt_async_budget'])} | "
            f"{r['load_before']} → {r['load_after']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=10, help="alternations of the four modes")
    parser.add_argument("--steps", type=int, default=4, help="steps per mode per round")
    parser.add_argument("--every", type=int, default=4, help="N of the snapshot-every-N column")
    parser.add_argument("--budget-steps", type=int, default=24,
                        help="steps per budget (and its plain) block, rounded to whole N-step periods")
    parser.add_argument("--ckpt-steps", type=int, default=2, help="steps per save_checkpoint-every-step block")
    parser.add_argument("--ckpt-dir", type=Path, default=None,
                        help="where save_checkpoint writes (default: a temporary directory under bench/results)")
    parser.add_argument("--table", type=Path, metavar="JSON",
                        help="print the README's table from a recorded run (its JSON) and exit")
    args = parser.parse_args()
    if args.table:
        print(markdown(json.loads(args.table.read_text())["rows"]))
        return
    ms.set_device("CPU")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(tempfile.mkdtemp(prefix="ckpt-", dir=args.ckpt_dir or RESULTS.parent))
    port = free_port()
    controller = start_controller(port)
    try:
        rows = []
        for batch in args.batch_sizes:
            # One controller per measurement: a rank that said Done ends the controller's job.
            if controller.poll() is not None:
                port = free_port()
                controller = start_controller(port)
            rows.append(measure(batch, args.rounds, args.steps, args.every, port, args.budget_steps,
                                args.ckpt_steps, ckpt_dir))
            controller.wait(30)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        if controller.poll() is None:
            controller.kill()
            controller.wait()
    every = rows[0]["snapshot_every"]
    header = (f"{'batch':>5} {'plain ms':>9} {'mindft ms':>10} {'ratio':>6} {'sync ms':>8} {'ratio':>6} "
              f"{f'every {every} ms':>11} {'ratio':>6} {'capture ms':>10} {'rollback→resumed ms':>20} "
              f"{'fault→resumed ms':>17} {'budget N':>8} {'ratio (min-max)':>20} {'load before/after':>30}")
    print(f"model: {rows[0]['parameters'] / 1e6:.1f}M parameters, {rows[0]['state_bytes'] / 2**20:.0f} MiB "
          f"of state (weights + Adam moments); {rows[0]['steps_per_mode']} steps per mode in alternating "
          f"blocks of {args.steps}; step times: median block means; ratios: median over rounds of adjacent "
          f"blocks")
    print(header)
    for r in rows:
        print(f"{r['batch']:>5} {r['plain_ms']:>9.1f} {r['mindft_ms']:>10.1f} {r['ratio']:>6.3f} "
              f"{r['mindft_sync_ms']:>8.1f} {r['ratio_sync']:>6.3f} {r['mindft_sparse_ms']:>11.1f} "
              f"{r['ratio_sparse']:>6.3f} {r['capture_alone_ms']:>10.1f} "
              f"{r['rollback_to_resumed_ms']:>20.1f} {r['fault_to_resumed_ms']:>17.1f} {r['budget_every']:>8} "
              f"{r['ratio_budget']:.3f} ({r['ratio_budget_min']:.3f}-{r['ratio_budget_max']:.3f}) "
              f"{r['load_before']:>14} / {r['load_after']}")
    print("MindSpore save_checkpoint of the same state, ratio to plain steps (min / median / max over rounds):")
    print(f"{'batch':>5} {'every step, sync':>24} {'every step, async':>24} {'every N, sync':>24} "
          f"{'every N, async':>24} {'mindft every N':>24}")
    for r in rows:
        def spread(v: list) -> str:
            return f"{v[0]:.3f} / {v[1]:.3f} / {v[2]:.3f}"
        print(f"{r['batch']:>5} {spread(r['ratio_ckpt_sync']):>24} {spread(r['ratio_ckpt_async']):>24} "
              f"{spread(r['ratio_ckpt_sync_budget']):>24} {spread(r['ratio_ckpt_async_budget']):>24} "
              f"{spread([r['ratio_budget_min'], r['ratio_budget'], r['ratio_budget_max']]):>24}  (N={r['budget_every']})")
    worst = max(r["ratio"] for r in rows)
    print("mindft: snapshot after every step, copy overlapped with the next step's forward/backward; "
          f"sync: copy not overlapped; every {every}: snapshot every {every}th step (overlapped)")
    print(f"overhead ratio, snapshot every step (worst batch size): {worst:.3f} — target <= {TARGET}: "
          f"{'met' if worst <= TARGET else 'NOT met'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"target": TARGET, "worst_ratio": worst, "rows": rows,
                                   "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                               "mindspore": ms.__version__}}, indent=1))
    print(f"wrote {RESULTS}; the README's table (ratios: min / median / max over rounds):")
    print(markdown(rows))


if __name__ == "__main__":
    main()
