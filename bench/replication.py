"""Step time of a 2-node job on loopback: replicas pushed by the ranks vs streamed by the node agents.

Two ``mindft-launch`` processes on 127.0.0.1 play two nodes, one rank each (CurveZMQ on, as
in production). Each rank trains an MLP with Adam in MindSpore PyNative mode through
``FaultTolerantLoop`` (a snapshot after every step) and records its step times. Modes,
interleaved round by round so they see the same machine:

- ``none``: MS_ENABLE_TFT unset (no mindft at all), the floor;
- ``rank_push``: MINDFT_AGENT_REPLICATION=0, each rank pushes its snapshot to its buddy rank
  on the next node after every capture, before it reports the step (mindft before agent replication);
- ``agent``: the node agents stream the newest snapshots in the background (the default).

Reported per mode: the median step time of each job (warm-up steps dropped) and min/median/max
over rounds, the ratio to ``none`` and of ``agent`` to ``rank_push``, replicas sent, lost-protection
warnings, and the load average before and after each job.

    python bench/replication.py [--width 2048] [--steps 40] [--rounds 3]
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

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "replication.json"
MODES = ("none", "rank_push", "agent")
WARMUP = 5
IN_OUT = 1024
RANK_VARIABLE = "BENCH_REPLICATION_OUT"


def rank_main() -> None:
    """One rank: train, time every step, write the times to $BENCH_REPLICATION_OUT/rank<R>.json."""
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    from mindft.config import load_config
    from mindft.mindspore import FaultTolerantLoop

    width, steps, batch = (int(os.environ[f"BENCH_REPLICATION_{name}"]) for name in ("WIDTH", "STEPS", "BATCH"))
    ms.set_device("CPU")
    ms.set_seed(0)
    net = nn.SequentialCell(nn.Dense(IN_OUT, width), nn.ReLU(), nn.Dense(width, width), nn.ReLU(),
                            nn.Dense(width, IN_OUT))
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-4)
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    train_step.set_train()
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.random((batch, IN_OUT), dtype=np.float32))
    y = ms.Tensor(rng.random((batch, IN_OUT), dtype=np.float32))

    def run(xb: ms.Tensor, yb: ms.Tensor) -> None:
        train_step(xb, yb).asnumpy()

    config = load_config()
    times = []
    with FaultTolerantLoop(net, optimizer) as loop:
        for _ in range(steps):
            start = time.perf_counter()
            loop.step(run, x, y)
            times.append(time.perf_counter() - start)
        state = sum(p.asnumpy().nbytes for p in train_step.get_parameters())
    out = Path(os.environ[RANK_VARIABLE])
    (out / f"rank{config.rank}.json").write_text(json.dumps({"times": times, "state_bytes": state}))


def free_port_pair() -> int:
    sys.path.insert(0, str(REPO))
    from mindft.launch import free_port_pair as pick

    return pick("127.0.0.1")


def run_job(mode: str, args: argparse.Namespace, keys: Path, work: Path) -> dict:
    out = work / mode
    out.mkdir(parents=True)
    port = free_port_pair()
    env = dict(os.environ, PYTHONPATH=str(REPO), **{RANK_VARIABLE: str(out)},
               BENCH_REPLICATION_WIDTH=str(args.width), BENCH_REPLICATION_STEPS=str(args.steps),
               BENCH_REPLICATION_BATCH=str(args.batch), MINDFT_RESET_FILE=str(work / "reset.json"),
               MINDFT_AGENT_REPLICATION="0" if mode == "rank_push" else "1", MINDFT_REGISTER_TIMEOUT="300")
    for name in ("MINDFT_KEY_FILE", "MINDFT_INSECURE", "MS_TFT_PORT", "MINDFT_REPLICA_BUDDY"):
        env.pop(name, None)
    if mode == "none":
        env.pop("MS_ENABLE_TFT", None)
    else:
        env["MS_ENABLE_TFT"] = "{RSC:1}"
    load_before = os.getloadavg()
    launchers, logs = [], []
    for node in (1, 0):
        log_path = out / f"node{node}.out"
        logs.append(log_path)
        with open(log_path, "wb") as handle:
            launchers.append(subprocess.Popen(
                [sys.executable, "-m", "mindft.launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node),
                 "--master-port", str(port), "--no-scheduler", "--key-file", str(keys), "--run-dir",
                 str(out / f"run{node}"), __file__], env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                start_new_session=True))
    try:
        codes = [launcher.wait(args.timeout) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGTERM)
                launcher.wait(30)
    text = "\n".join(path.read_text(errors="replace") for path in logs)
    if codes != [0, 0]:
        raise SystemExit(f"{mode}: launchers exited {codes}:\n{text[-4000:]}")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    medians = [statistics.median(r["times"][WARMUP:]) for r in ranks]
    sent = [int(n) for n in re.findall(r"replication: sent (\d+) replica", text)]
    return {"mode": mode, "step_ms": max(medians) * 1e3, "per_rank_ms": [m * 1e3 for m in medians],
            "state_bytes": ranks[0]["state_bytes"], "replicas_sent": sum(sent) if sent else None,
            "lost_protection_warnings": text.count("LOST PROTECTION"),
            "push_failures": text.count("replica push of step"),
            "load_before": load_before[0], "load_after": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the MLP (2048: ~8.4M parameters)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    jobs = []
    with tempfile.TemporaryDirectory(prefix="mindft-bench-replication-") as tmp:
        work = Path(tmp)
        keys = work / "keys.json"
        subprocess.run([sys.executable, "-c", "from mindft.cli import main; main()", "keygen", str(keys)], check=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True)
        for round_ in range(args.rounds):
            for mode in MODES:
                job = run_job(mode, args, keys, work / f"round{round_}")
                job["round"] = round_
                jobs.append(job)
                print(f"round {round_} {mode:>9}: step {job['step_ms']:7.1f} ms  (ranks {job['per_rank_ms'][0]:.1f}, "
                      f"{job['per_rank_ms'][1]:.1f}; replicas sent {job['replicas_sent']}, lost-protection "
                      f"warnings {job['lost_protection_warnings']}, load {job['load_before']:.2f}→"
                      f"{job['load_after']:.2f})", flush=True)
    summary = {}
    for mode in MODES:
        values = [j["step_ms"] for j in jobs if j["mode"] == mode]
        summary[mode] = {"min_ms": min(values), "median_ms": statistics.median(values), "max_ms": max(values)}
    by_round = {(j["round"], j["mode"]): j["step_ms"] for j in jobs}
    ratios = {name: statistics.median(by_round[(r, a)] / by_round[(r, b)] for r in range(args.rounds))
              for name, a, b in (("rank_push/none", "rank_push", "none"), ("agent/none", "agent", "none"),
                                 ("agent/rank_push", "agent", "rank_push"))}
    result = {"benchmark": "replication", "width": args.width, "batch": args.batch, "steps": args.steps,
              "state_bytes": jobs[0]["state_bytes"], "rounds": args.rounds, "cpus": os.cpu_count(),
              "machine": platform.platform(), "jobs": jobs, "summary": summary, "ratios": ratios}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    print(f"state per rank {jobs[0]['state_bytes'] / 2**20:.0f} MiB; median step (min/median/max over rounds):")
    for mode in MODES:
        s = summary[mode]
        print(f"  {mode:>9}: {s['min_ms']:.1f} / {s['median_ms']:.1f} / {s['max_ms']:.1f} ms")
    print("ratios (median over rounds): " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    if os.environ.get(RANK_VARIABLE):
        rank_main()
    else:
        main()
