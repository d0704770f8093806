"""A node lost → training resumed: the node restarted in place, against a warm spare, against node 0
lost with a standby controller and a spare; and what a standby costs while nothing is lost.

Three hosts made of network namespaces on one bridge (needs root and iproute2's ``ip``; the
harness of tests/integration/agent/test_three_hosts.py), examples/train_dp.py data-parallel with MCCL
across the links, one rank per node, in one run:

* (a) **node 1 restarted in place**: every process of host 1 killed, its launcher started again
  3 s later with the same ``--node-rank`` (a pod restarted by Volcano);
* (b) **node 1 given to a spare**: the same loss, never back; ``mindft-launch --spare`` on host 2
  takes its rank;
* (c) **node 0 lost, a standby takes command**: ``--standbys 1``, node 0 never back: node 1's
  standby controller rebuilds the job and the spare takes rank 0;
* (d) **the standby's cost in the steady state**: the same job without a fault, plain, with
  ``--standbys 1``, and with ``--standbys 1`` and a spare, side by side: the launchers' CPU seconds
  (their own and their processes', ranks included) and the bytes of a node agent's hello (one
  every 2 s either way).

"Resumed" is the controller's move back to NORMAL after the loss (its event log, wall clock);
"exited" is every launcher's exit.

    sudo python bench/node_loss.py           # (a), (b), (c), (d) once (~4 min on 2 cores)
    sudo python bench/node_loss.py --quick   # (c) and (d) with a standby and a spare: every path once
Writes bench/results/node_loss.json.
"""
from __future__ import annotations

import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, results_parser

sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the tree under test, and the hosts harness

from harness import Hosts, Processes, hosts_or_skip  # noqa: E402
from host_jobs import HostsJob  # noqa: E402
from mindft.observe.events import read  # noqa: E402
from mindft.protocol import AgentHello, encode  # noqa: E402

SPARE_HOST = 2


def resumed_after(run_dir: Path, lost_wall: float) -> float:
    """Seconds from the loss to the job training again (the controller's first move to NORMAL after it)."""
    return next(e.at for e in read(run_dir) if e.kind == "transition" and e.at > lost_wall
                and e.record.to_state == "NORMAL") - lost_wall


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_loss(name: str, tmp: Path, node: int, spare: bool, again_after: float, standbys: bool) -> dict:
    tmp.mkdir(parents=True)
    hosts, processes = Hosts(3), Processes()
    try:
        job = HostsJob(hosts, processes, tmp, launch_args=("--standbys", "1") if standbys else ())
        if spare:
            job.start("spare", None, host=SPARE_HOST)
        job.start_training()
        lost_wall, lost_at = time.time(), job.lose(f"node{node}", node)
        if again_after:
            time.sleep(again_after)
            job.start(f"node{node}-again", node)
        names = [n for n in job.launchers if n != f"node{node}"]
        codes = {n: job.wait(n) for n in names}
        exited = time.monotonic() - lost_at
        controller_dir = tmp / ("run-node1" if node == 0 else "run-node0")
        return {"case": name, "codes": codes, "resumed_s": round(resumed_after(controller_dir, lost_wall), 2),
                "exited_s": round(exited, 2)}
    finally:
        processes.kill_all()
        hosts.close()


def run_steady(tmp: Path, standbys: bool, spare: bool) -> dict:
    tmp.mkdir(parents=True)
    hosts, processes = Hosts(3), Processes()
    try:
        job = HostsJob(hosts, processes, tmp, launch_args=("--standbys", "1") if standbys else ())
        before, started = children_cpu(), time.monotonic()
        if spare:
            job.start("spare", None, host=SPARE_HOST)
        for node in (0, 1):
            job.start(f"node{node}", node)
        codes = {n: job.wait(n) for n in list(job.launchers)}
        return {"standbys": standbys, "spare": spare, "codes": codes, "wall_s": round(time.monotonic() - started, 2),
                "cpu_s": round(children_cpu() - before, 2)}
    finally:
        processes.kill_all()
        hosts.close()


LOSSES = (("(a) node 1 restarted in place after 3 s", 1, False, 3.0, False),
          ("(b) node 1 given to a spare", 1, True, 0.0, False),
          ("(c) node 0 lost: standby + spare", 0, True, 0.0, True))
STEADY = ((False, False, "plain"), (True, False, "--standbys 1"), (True, True, "--standbys 1 and a spare"))


def main() -> None:
    args = results_parser(__doc__, "node_loss", "only (c) and (d) with a standby and a spare").parse_args()
    hosts_or_skip()
    results: dict = {"benchmark": "node_loss", "machine": platform.node(), "losses": [], "steady": []}
    with tempfile.TemporaryDirectory(prefix="mindft-bench-node-loss-") as tmp:
        root = Path(tmp)
        for name, node, spare, again, standbys in LOSSES[-1:] if args.quick else LOSSES:
            result = run_loss(name, root / f"loss{len(results['losses'])}", node, spare, again, standbys)
            results["losses"].append(result)
            print(f"{name}: training resumed {result['resumed_s']:.1f} s after the loss, every launcher exited "
                  f"{result['exited_s']:.1f} s after it {result['codes']}", flush=True)
        for standbys, spare, what in STEADY[-1:] if args.quick else STEADY:
            result = {"mode": what, **run_steady(root / f"steady{len(results['steady'])}", standbys, spare)}
            results["steady"].append(result)
            print(f"(d) no fault, {what}: {result['wall_s']:.1f} s, {result['cpu_s']:.1f} CPU s {result['codes']}",
                  flush=True)
    plain = len(encode(AgentHello(1, (1,), (4242,), (0,), (63,), "tcp://10.77.0.2:41234", (0,), (63,))))
    standby = len(encode(AgentHello(1, (1,), (4242,), (0,), (63,), "tcp://10.77.0.2:41234", (0,), (63,),
                                    address="tcp://10.77.0.2:29601", term=0)))
    results["hello_bytes"] = {"plain": plain, "standby": standby, "every_s": 2.0}
    print(f"(d) a node agent's hello: {plain} bytes, {standby} with the standby's address and term, one every 2 s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
