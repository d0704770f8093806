"""A node lost for good → training again: an elastic job that shrinks, against waiting for the node,
against a dying gasp and a fresh job on the nodes left; and the throughput on the smaller world.

Three hosts made of network namespaces on one bridge (needs root and iproute2's ``ip``; the harness
of tests/integration/agent/test_elastic_hosts.py), examples/train_elastic.py data-parallel with MCCL
across the links, one rank per node, no spare; node 2 (every process of its host, its shared memory)
lost at step 80 (8 with ``--quick``). Three ways, in one run:

* (a) **shrink**: ``--nnodes 2:3``, ``MINDFT_SHRINK_AFTER=3``: the job goes on with nodes 0 and 1;
  the steps per second before the loss (3 ranks) and after (2 ranks), from rank 0's step records;
* (b) **wait for the node**: ``--nnodes 3``, node 2's launcher started again 30 s (10 s) after the
  loss (a pod rescheduled);
* (c) **dying gasp, then a new job**: ``--nnodes 3``, node 2 never back: the job ends with its dying
  gasps after ``MINDFT_REPAIR_TIMEOUT`` (20 s, 10 s; mindft's default: 180 s), then a fresh 2-node job
  starts on hosts 0 and 1. train_elastic.py cannot resume from dying gasps (only train_dp.py
  ``--loop`` can), so (c) is the failed job's end plus a fresh job's start until its first step: the
  time a user pays, without loading the checkpoint (a few KB here).

"Training again" for (a) and (b) is the controller's first move to NORMAL after the loss (node 0's
event log, wall clock), for (c) the fresh job's status NORMAL at step >= 1.

    sudo python bench/elastic.py           # (a), (b), (c) once (~4 min on 2 cores)
    sudo python bench/elastic.py --quick   # fewer steps, shorter waits: every path once (~2 min)
Writes bench/results/elastic.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, results_parser

sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the tree under test, and the hosts harness

from harness import Hosts, Processes, hosts_or_skip  # noqa: E402
from host_jobs import HostsJob  # noqa: E402
from mindft.config import Timeouts  # noqa: E402
from mindft.observe.events import WorldResized, read  # noqa: E402
from node_loss import resumed_after  # noqa: E402

SCRIPT = REPO / "examples" / "train_elastic.py"
STEP_SECONDS = "0.05"
SHRINK_AFTER = "3"
DEFAULT_REPAIR = Timeouts().repair
WARM_UP = 2  # a world's first steps after its processes start run slower (PyNative's first calls)


def steps_per_second(records: Path, world: int, before: float = float("inf"), after: float = 0.0) -> float:
    """Rank 0's steady rate on a world of ``world`` ranks, between two wall times: step ends are recorded,
    so n records span n - 1 steps."""
    times = sorted(entry["t"] for path in records.glob("steps-*.jsonl") for entry in map(json.loads, path.open())
                   if entry["rank"] == 0 and entry["world"] == world and after < entry["t"] < before)[WARM_UP:]
    return (len(times) - 1) / (times[-1] - times[0])


def trained_until(job: HostsJob, step: int) -> None:
    job.start_training()
    job.until(f"step {step}", lambda status: status.state == "NORMAL" and status.step >= step)


def shrink(tmp: Path, hosts: Hosts, processes: Processes, args: argparse.Namespace) -> dict:
    records = tmp / "records"
    job = HostsJob(hosts, processes, tmp, "--record", str(records), nodes=3, node_range="2:3", script=SCRIPT,
                   job_args=args.job_args, MINDFT_SHRINK_AFTER=SHRINK_AFTER)
    trained_until(job, args.lose_at)
    lost_wall, _ = time.time(), job.lose("node2", 2)
    codes = {name: job.wait(name) for name in ("node0", "node1")}
    events = read(tmp / "run-node0")
    resized = next(e.at for e in events if isinstance(e.record, WorldResized) and e.at > lost_wall)
    resumed = resumed_after(tmp / "run-node0", lost_wall)
    before = steps_per_second(records, 3, before=lost_wall)
    after = steps_per_second(records, 2, after=lost_wall)
    return {"codes": codes, "resized_after_seconds": round(resized - lost_wall, 2),
            "resumed_after_seconds": round(resumed, 2), "steps_per_second_before": round(before, 2),
            "steps_per_second_after": round(after, 2), "after_over_before": round(after / before, 3)}


def wait_for_node(tmp: Path, hosts: Hosts, processes: Processes, args: argparse.Namespace) -> dict:
    job = HostsJob(hosts, processes, tmp, nodes=3, script=SCRIPT, job_args=args.job_args)
    trained_until(job, args.lose_at)
    lost_wall, _ = time.time(), job.lose("node2", 2)
    time.sleep(args.again_after)
    job.start("node2-again", 2)
    codes = {name: job.wait(name) for name in ("node0", "node1", "node2-again")}
    return {"codes": codes, "again_after_seconds": args.again_after,
            "resumed_after_seconds": round(resumed_after(tmp / "run-node0", lost_wall), 2)}


def gasp_and_new_job(tmp: Path, hosts: Hosts, processes: Processes, args: argparse.Namespace) -> dict:
    (tmp / "failed").mkdir()
    job = HostsJob(hosts, processes, tmp / "failed", nodes=3, script=SCRIPT, job_args=args.job_args,
                   MINDFT_REPAIR_TIMEOUT=str(args.repair))
    trained_until(job, args.lose_at)
    lost_at = job.lose("node2", 2)
    codes = {name: job.wait(name) for name in ("node0", "node1")}  # mindft.exitcodes.ExitCode.DUMPED: 3
    ended = time.monotonic() - lost_at
    (tmp / "fresh").mkdir()
    fresh = HostsJob(hosts, processes, tmp / "fresh", nodes=2, script=SCRIPT, job_args=args.job_args)
    started = time.monotonic()
    for node in (0, 1):
        fresh.start(f"node{node}", node)
    fresh.until("the fresh job's first step", lambda status: status.state == "NORMAL" and status.step >= 1)
    start_up = time.monotonic() - started
    # To its end: killed, its agents would leave their memory in /dev/shm.
    codes.update({f"fresh {name}": fresh.wait(name) for name in ("node0", "node1")})
    return {"codes": codes, "repair_timeout_seconds": args.repair, "ended_after_seconds": round(ended, 2),
            "fresh_start_seconds": round(start_up, 2), "resumed_after_seconds": round(ended + start_up, 2),
            # The repair timeout is waited in full: mindft's default instead of the shortened one.
            "resumed_after_seconds_at_default_repair": round(ended + start_up + DEFAULT_REPAIR - args.repair, 2)}


WAYS = (("a", "shrink: --nnodes 2:3, --shrink-after 3", shrink),
        ("b", "wait for node 2's launcher again", wait_for_node),
        ("c", "dying gasp, then a fresh 2-node job", gasp_and_new_job))


def run_way(way: str, case: str, measure, root: Path, args: argparse.Namespace) -> dict:
    tmp = root / way
    tmp.mkdir()
    hosts, processes = Hosts(3), Processes()
    try:
        return {"way": way, "case": case, **measure(tmp, hosts, processes, args)}
    finally:
        processes.kill_all()
        hosts.close()


def main() -> None:
    args = results_parser(__doc__, "elastic", "fewer steps, shorter waits: every path once").parse_args()
    hosts_or_skip()
    # Full form: enough steps on each world for a steady rate (~0.1 s a step on 2 cores).
    steps, args.lose_at, args.again_after, args.repair = (40, 8, 5.0, 8) if args.quick else (400, 80, 30.0, 20)
    args.job_args = ("--steps", str(steps), "--step-seconds", STEP_SECONDS)
    results: dict = {"benchmark": "elastic", "machine": platform.node(), "quick": args.quick,
                     "date": time.strftime("%Y-%m-%d"), "load_before": round(os.getloadavg()[0], 2),
                     "config": {"steps": steps, "step_seconds": float(STEP_SECONDS), "lose_at_step": args.lose_at,
                                "shrink_after": float(SHRINK_AFTER), "again_after": args.again_after,
                                "repair_timeout": args.repair},
                     "ways": {}}
    with tempfile.TemporaryDirectory(prefix="mindft-bench-elastic-") as tmp:
        for way, case, measure in WAYS:
            result = results["ways"][way] = run_way(way, case, measure, Path(tmp), args)
            print(f"({way}) {case}: training again {result['resumed_after_seconds']:.1f} s after the loss "
                  f"{result['codes']}", flush=True)
    results["load_after"] = round(os.getloadavg()[0], 2)
    a, c = results["ways"]["a"], results["ways"]["c"]
    print("\n| way | loss → training again |\n|---|---|")
    for way, case, _ in WAYS:
        print(f"| ({way}) {case} | {results['ways'][way]['resumed_after_seconds']:.1f} s |")
    print(f"\n(a) steps per second: {a['steps_per_second_before']:.2f} on 3 ranks, {a['steps_per_second_after']:.2f} "
          f"on 2 ranks (×{a['after_over_before']:.2f}); the world resized {a['resized_after_seconds']:.1f} s after "
          f"the loss\n(c) the failed job ended {c['ended_after_seconds']:.1f} s after the loss, the fresh job "
          f"trained {c['fresh_start_seconds']:.1f} s after its start "
          f"({c['resumed_after_seconds_at_default_repair']:.0f} s after the loss with the default repair timeout, "
          f"{DEFAULT_REPAIR:g} s)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
