"""Latency of one pause → rollback → resume round against the number of ranks.

Protocol only (no model state): a real mindft Controller (on a thread of this process)
and N ranks that acknowledge PAUSE, ROLLBACK and RESUME. Each round is started from
NORMAL by a device reset of rank 0 reported together with its recovery (as the reset
watcher would), so REPAIRING has nothing to wait for. The latency is the controller's
own measurement: from the fault's arrival to the last RESUME acknowledgement (NORMAL
again), with the time in each phase. One warm-up round (not measured) comes first.

* real ranks: 2, 4, 8, 16 processes, each a mindft Processor (its own I/O thread) obeying
  the controller through ``Processor.follow`` and idle hooks (nothing to settle or restore);
* simulated ranks: 64 … 16384 TCP connections spread over 2 worker processes, each holding
  its ranks' connections in one ROUTER socket driven from one thread (each connection
  introduces itself as the rank's DEALER would, so the controller sees one peer per rank)
  and speaking the wire protocol: PAUSE acknowledged with the steps held, ROLLBACK and
  RESUME acknowledged, Done after the last round, then FINISH; like a Processor, a
  simulated rank heartbeats only after an interval with nothing sent or heard. Each worker
  counts the frames of each kind it sent and heard (the heartbeat share); the first fault
  comes once every simulated rank heard the start barrier's answer;
* relayed ranks (issue 46): 4096 … 100000 ranks behind simulated node agents of ``--nproc``
  ranks (8), one connection per node (the same one-ROUTER trick, the connection introducing
  itself as ``agent/<node>/sim``), speaking protocol 15's relay wire: each rank's Register and
  Done relayed as [its identity, frame], each broadcast PAUSE / ROLLBACK / RESUME heard once
  per node and acknowledged with one AckBatch of its ranks, a StepBatch of its ranks as the
  node's heartbeat after an idle interval. The node agent's own memory is not measured: a
  simulated node is a slice of a worker's loop, not an agent;
* the bare-pyzmq floor at each simulated size, right after it: the same connections, driven
  the same way, doing three broadcast + gather phases of fixed frames with no mindft logic
  (relayed: one message per node each way).

Per size: the controller's round (median), its thread's CPU per round, and its memory (the
growth of this process's RSS from before the controller starts to once every rank registered).

    python bench/coordination.py            # full table (~10 minutes on 2 cores)
    python bench/coordination.py --quick    # smaller sizes, fewer rounds (~30 s)
    python bench/coordination.py --real-sizes 0 --sim-sizes 4096,16384   # the large sizes only
    python bench/coordination.py --real-sizes 0 --sim-sizes 4096,16384 \
        --relay-sizes 4096,16384,65536,100000 --nproc 8     # issue 46: relays beside the star
The simulated ranks, node agents and floor peers are bench/sim_ranks.py's worker processes.
Writes bench/results/coordination.json (--output). 16384 ranks need ~17 500 file descriptors
(``ulimit -n``) in the benchmark process and in each worker (relayed: one per node).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path
from typing import Callable, Optional

import zmq

from mindft.net import channel
from mindft.config import MindftConfig, Timeouts
from mindft.controller import Controller
from mindft.exitcodes import ExitCode
from mindft.flow import DeviceFaulty, DeviceRecovered, JobState, phase_times
from mindft.net.keys import generate_keys
from mindft.rank.processor import Processor
from mindft.protocol import FaultKind
from mindft.rank.loop import RankLoop

from sim_ranks import HELD, SIM_TIMEOUTS, WARMUP

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "coordination.json"
SIM_RANKS = str(HERE / "sim_ranks.py")  # the simulated ranks' and node agents' worker processes
TARGET_REAL_16 = 0.050
TARGET_SIM_4096 = 1.0
TARGET_SIM_16384 = 2.0
SIM_WORKERS = 2
# Generous liveness for the benchmark: a loaded 2-core box must not declare ranks dead.
REAL_TIMEOUTS = Timeouts(heartbeat_interval=0.5, heartbeat_misses=20, register=120.0, pause=60.0,
                         repair=60.0, rollback=60.0, resume=60.0)
SIM_SIZES = [64, 256, 1024, 4096, 16384]
# The relay topology: simulated nodes of NPROC ranks, each node agent one connection to the controller.
RELAY_SIZES = [4096, 16384, 65536, 100000]
NPROC = 8
TARGET_RELAY_16384 = 0.3  # issue 46: a round at 2 048 nodes of 8
TARGET_RELAY_100000 = 1.5  # issue 46: a round at 12 500 nodes of 8
TRIGGER_GAP = 0.01  # seconds between the end of a round and the next fault
PHASES = (JobState.PAUSING, JobState.REPAIRING, JobState.ROLLBACK, JobState.RESUMING)


# ---- the trigger ---------------------------------------------------------------------------

def drive_rounds(controller: Controller, thread: threading.Thread, rounds: int, timeout: float,
                 settled: Optional[Callable[[], bool]] = None,
                 ready: Optional[Callable[[], None]] = None) -> list[float]:
    """Run ``WARMUP + rounds`` recoveries one after the other; the controller thread's CPU
    seconds per measured round.

    The fault is a device reset of rank 0 reported by the reset watcher together with its
    recovery, so REPAIRING has nothing to wait for: the round is pure protocol. The first
    fault comes once ``settled()`` (when given) says every rank heard the start barrier's
    answer: a training job is past its start when a fault hits, and a round that overlapped
    the start barrier's broadcast to 16 384 ranks would measure that broadcast too. ``ready()``
    (when given) is called then, before the first round (to weigh the registered job).
    """
    clock = time.pthread_getcpuclockid(thread.ident)
    deadline = time.monotonic() + timeout
    cpu = []

    def check(what: str) -> None:
        if controller.join(0) is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: controller {controller.latest_status().state}")

    # Once, before any round: every rank registered (a status costs the controller O(ranks)).
    while controller.latest_status(timeout=120.0).state != JobState.NORMAL.value:
        check("the ranks did not all register")
        time.sleep(0.1)
    while settled is not None and not settled():
        check("the ranks did not all hear the start barrier's answer")
        time.sleep(0.1)
    if ready is not None:
        ready()

    def wait_for(count: int) -> None:
        # recovery_times grows when a round ends (RESUMING → NORMAL); reading its length does
        # not wake the controller, so polling it leaves the measured round undisturbed.
        while len(controller.recovery_times) < count:
            check(f"round {count} did not finish")
            time.sleep(0.02)  # coarse: this thread shares the GIL with the controller's

    for done in range(WARMUP + rounds):
        time.sleep(TRIGGER_GAP)
        before = time.clock_gettime(clock)
        reset(controller)
        wait_for(done + 1)
        try:
            if done >= WARMUP:
                cpu.append(time.clock_gettime(clock) - before)
        except OSError:  # the controller thread ended (DONE) right after the last round
            pass
    return cpu


def reset(controller: Controller) -> None:
    """Rank 0's device reset and its recovery, handled by the controller in one turn, as the reset
    watcher reports a reset it finds already over. Two on_device_event calls would race the
    round: a controller that takes the fault alone and gathers every PAUSE acknowledgement before
    the recovery is queued (a loaded box, a small job) tells rank 0 to leave its chip, which no
    simulated rank does, and waits timeouts.leave and then timeouts.repair for its exit."""
    controller.on_device_event(DeviceFaulty(0, "bench", "reset"), DeviceRecovered(0))


def start_controller(n: int, secure: bool, tmp: Path, timeouts: Timeouts) -> tuple[Controller, str, threading.Thread]:
    key_file = None
    if secure:
        key_file = tmp / "bench.key"
        generate_keys(key_file)
    config = MindftConfig(world_size=n, controller_port=0, insecure=not secure, key_file=key_file,
                          timeouts=timeouts)
    controller = Controller(config)
    thread = controller.start()
    return controller, str(key_file or ""), thread


def recovery_phases(history: list[tuple[JobState, float]]) -> list[dict[str, float]]:
    """Seconds in each recovery state, per completed recovery, from the job's state history."""
    phases, start = [], None
    for index, (state, _) in enumerate(history):
        if state is JobState.PAUSING and start is None:
            start = index
        elif state is JobState.NORMAL and start is not None:
            segment = history[start:index + 1]
            phases.append(phase_times(segment, segment[0][1]))
            start = None
    return phases


def reap(procs: list[subprocess.Popen]) -> None:
    """Kill and wait for whatever a measurement left running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finish(controller: Controller, thread: threading.Thread, procs: list[subprocess.Popen], rounds: int,
           what: str, settled: Optional[Callable[[], bool]] = None,
           ready: Optional[Callable[[], None]] = None) -> list[float]:
    try:
        cpu = drive_rounds(controller, thread, rounds, 900, settled, ready)
        result = controller.join(300)
        for proc in procs:
            proc.wait(120)
    finally:
        reap(procs)
        controller.stop()
    if result is None or result.exit_code != ExitCode.OK:
        raise RuntimeError(f"{what} failed: {result}")
    return cpu


# ---- real ranks ---------------------------------------------------------------------------

class IdleRank:
    """RankHooks of a rank with no model: it always holds step 0 and has nothing to restore."""

    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    def settle(self) -> tuple[int, ...]:
        return HELD

    def restore(self, step: int) -> tuple[int, ...]:
        return HELD

    def resume(self, step: int) -> None:
        pass

    def arm(self, fault: FaultKind, detail: str) -> None:
        raise RuntimeError(f"the benchmark injects no faults, got {fault.name}: {detail}")

    def dump_and_exit(self, step: int, reason: str) -> typing.NoReturn:
        self.processor.close()
        sys.exit(ExitCode.DUMPED)


def real_rank_main(rounds: int) -> None:
    """One rank process: the rank engine's loop over a mindft Processor, following the controller
    for ``rounds`` rounds."""
    from mindft.config import load_config
    config = load_config()
    processor = Processor(config, f"bench://{config.rank}")
    loop = RankLoop(processor, IdleRank(processor))
    loop.register(HELD)
    resumed = 0
    while resumed < rounds:
        if loop.follow() is not None:  # None only for FINISH or an armed fault
            resumed += 1
        elif loop.finished_job:
            raise RuntimeError(f"rank {config.rank}: the job finished after {resumed} of {rounds} rounds")
    if loop.finish(0) is not None:
        raise RuntimeError(f"rank {config.rank}: a recovery after Done; the benchmark triggers none")
    processor.close()


def run_real(n: int, rounds: int, secure: bool, tmp: Path) -> dict:
    controller, key_file, thread = start_controller(n, secure, tmp, REAL_TIMEOUTS)
    t = REAL_TIMEOUTS
    base = dict(os.environ, MS_WORKER_NUM=str(n), MS_TFT_PORT=controller.endpoint.rsplit(":", 1)[1],
                MINDFT_HEARTBEAT_INTERVAL=str(t.heartbeat_interval),
                MINDFT_HEARTBEAT_MISSES=str(t.heartbeat_misses))
    if secure:
        base["MINDFT_KEY_FILE"] = key_file
        base.pop("MINDFT_INSECURE", None)
    else:
        base["MINDFT_INSECURE"] = "1"
    procs = [subprocess.Popen([sys.executable, __file__, "--real-rank", "--rounds", str(WARMUP + rounds)],
                              env=dict(base, MS_NODE_ID=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for r in range(n)]
    cpu = finish(controller, thread, procs, rounds, f"real run with {n} ranks")
    return summarize("real", n, controller, secure, cpu)


# ---- simulated ranks ----------------------------------------------------------------------

def run_sim(n: int, rounds: int, secure: bool, tmp: Path) -> dict:
    """A recovery round of ``n`` ranks, each its own connection to the controller (the flat star)."""
    rss_before = process_rss()
    controller, key_file, thread = start_controller(n, secure, tmp, SIM_TIMEOUTS)
    port = controller.endpoint.rsplit(":", 1)[1]
    share = -(-n // SIM_WORKERS)
    stats = [tmp / f"sim-{n}-{first}.json" for first in range(0, n, share)]
    procs = [subprocess.Popen([sys.executable, SIM_RANKS, "--sim-worker", str(first),
                               str(min(share, n - first)), port, str(WARMUP + rounds), key_file, str(path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for first, path in zip(range(0, n, share), stats)]
    registered: list[int] = []
    cpu = finish(controller, thread, procs, rounds, f"simulated run with {n} ranks",
                 settled=lambda: all(Path(f"{path}.ready").exists() for path in stats),
                 ready=lambda: registered.append(process_rss()))
    row = summarize("simulated", n, controller, secure, cpu)
    row.update(controller_rss_mb=(registered[0] - rss_before) / 2**20 if registered else float("nan"))
    row.update(traffic(stats))
    return row


def traffic(stats: list[Path]) -> dict:
    """What the simulated peers sent and heard, summed over the workers' ``stats`` files: during
    the rounds, and over the whole run, with the heartbeats' share of the frames."""
    sent: dict[str, dict[str, int]] = {"setup": {}, "rounds": {}}
    received: dict[str, dict[str, int]] = {"setup": {}, "rounds": {}}
    for path in stats:
        counts = json.loads(path.read_text())
        for total, part in ((sent, counts["sent"]), (received, counts["received"])):
            for period, kinds in part.items():
                for name, value in kinds.items():
                    total[period][name] = total[period].get(name, 0) + value

    def share(counts: dict[str, dict[str, int]], name: str, periods: tuple[str, ...]) -> float:
        frames = [value for period in periods for value in counts[period].values()]
        return sum(counts[period].get(name, 0) for period in periods) / max(1, sum(frames))
    return dict(frames_to_controller=sent, frames_from_controller=received,
                heartbeat_share_in=share(sent, "heartbeat", ("rounds",)),
                heartbeat_share_out=share(received, "Heartbeat", ("rounds",)),
                heartbeat_share_in_whole_run=share(sent, "heartbeat", ("setup", "rounds")),
                heartbeat_share_out_whole_run=share(received, "Heartbeat", ("setup", "rounds")))


def process_rss() -> int:
    """This process's resident bytes once the garbage is collected and the C heap's free pages are
    handed back, so a run that follows a larger one does not measure its growth into the heap the
    larger one left behind."""
    import ctypes
    import gc

    import psutil
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the growth is then a lower bound
        pass
    return psutil.Process().memory_info().rss


# ---- simulated node agents that relay their ranks (protocol 15) ------------------------------

def run_relay(n: int, nproc: int, rounds: int, secure: bool, tmp: Path) -> dict:
    """A recovery round of ``n`` ranks behind node agents of ``nproc`` ranks that relay them."""
    nodes = -(-n // nproc)
    rss_before = process_rss()
    controller, key_file, thread = start_controller(n, secure, tmp, SIM_TIMEOUTS)
    port = controller.endpoint.rsplit(":", 1)[1]
    share = -(-nodes // SIM_WORKERS)
    stats = [tmp / f"relay-{n}-{first}.json" for first in range(0, nodes, share)]
    procs = [subprocess.Popen([sys.executable, SIM_RANKS, "--relay-worker", str(first), str(min(share, nodes - first)),
                               str(nproc), str(n), port, str(WARMUP + rounds), key_file, str(path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for first, path in zip(range(0, nodes, share), stats)]
    registered: list[int] = []
    cpu = finish(controller, thread, procs, rounds, f"relayed run with {n} ranks on {nodes} nodes",
                 settled=lambda: all(Path(f"{path}.ready").exists() for path in stats),
                 ready=lambda: registered.append(process_rss()))
    row = summarize("simulated", n, controller, secure, cpu, topology="relay")
    # No "agent_rss_mb": a simulated node is a slice of a worker's loop, not an agent; a real
    # agent's relay is what would have to be measured.
    row.update(nproc=nproc, nodes=nodes,
               controller_rss_mb=(registered[0] - rss_before) / 2**20 if registered else float("nan"))
    row.update(traffic(stats))
    return row


# ---- raw ZeroMQ floor ------------------------------------------------------------------------

def run_floor(n: int, rounds: int, nproc: int = 0) -> dict:
    """Three broadcast + gather phases with bare frames and no mindft logic: the box's floor. With
    ``nproc`` (the relay topology) one connection per node of ``nproc`` ranks, a broadcast of two
    frames to each node as the controller's to a relay ([b"", frame]) and one answer per node."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 10_000)
    router.setsockopt(zmq.BACKLOG, channel.ROUTER_BACKLOG)  # as the controller's: the ranks connect at once
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peers = -(-n // nproc) if nproc else n
    share = -(-peers // SIM_WORKERS)
    procs = [subprocess.Popen([sys.executable, SIM_RANKS, "--floor-worker", str(first),
                               str(min(share, peers - first)), str(port), str(nproc)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for first in range(0, peers, share)]
    go, stop = ([b"", b"go"], [b"", b"stop"]) if nproc else ([b"go"], [b"stop"])
    try:
        identities = [router.recv_multipart()[0] for _ in range(peers)]
        times = []
        for done in range(WARMUP + rounds):  # warmed up as the mindft run is
            time.sleep(TRIGGER_GAP)
            started = time.perf_counter()
            for _phase in range(3):
                for identity in identities:
                    router.send_multipart([identity, *go])
                for _ in range(peers):
                    router.recv_multipart()
            if done >= WARMUP:
                times.append(time.perf_counter() - started)
        for identity in identities:
            router.send_multipart([identity, *stop])
        for proc in procs:
            proc.wait(60)
    finally:
        reap(procs)
        context.destroy(0)
    return {"ranks": n, "rounds": rounds, "median_s": statistics.median(times), "all_s": times}


# ---- report -------------------------------------------------------------------------------

def summarize(kind: str, n: int, controller: Controller, secure: bool, cpu: list[float],
              topology: str = "star") -> dict:
    rounds = controller.recovery_times[WARMUP:]
    ordered = sorted(rounds)
    per_round = recovery_phases(controller.job.history)[WARMUP:]  # the controller has stopped: safe to read
    phases = {state.value: statistics.median(p.get(state.value, 0.0) for p in per_round) for state in PHASES}
    return {"kind": kind, "topology": topology, "ranks": n, "secure": secure, "rounds": len(rounds),
            "median_s": statistics.median(ordered),
            "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "min_s": ordered[0], "max_s": ordered[-1], "phase_median_s": phases,
            "controller_cpu_median_s": statistics.median(cpu) if cpu else float("nan"),
            "all_s": list(rounds)}


def print_table(rows: list[dict]) -> None:
    print(f"{'kind':<10} {'topo':<5} {'ranks':>6} {'curve':>5} {'rounds':>6} {'median ms':>10} {'p90 ms':>8} "
          f"{'pause':>7} {'rollbk':>7} {'resume':>7} {'ctl cpu':>8} {'ctl MB':>7} {'µs/rank':>8} "
          f"{'growth (latency/ranks)':>22} {'zmq floor ms':>12} {'floor growth':>12} {'x floor':>7}")
    previous = None
    for row in rows:
        growth = floor_growth = ""
        topology = row.get("topology", "star")
        if (previous is not None and previous["secure"] == row["secure"] and previous["kind"] == row["kind"]
                and previous.get("topology", "star") == topology):
            growth = (f"x{row['median_s'] / previous['median_s']:.2f}/"
                      f"x{row['ranks'] / previous['ranks']:.0f}")
            if row.get("floor_median_s") and previous.get("floor_median_s"):
                floor_growth = f"x{row['floor_median_s'] / previous['floor_median_s']:.2f}"
        rss = f"{row['controller_rss_mb']:.0f}" if "controller_rss_mb" in row else ""
        print(f"{row['kind']:<10} {topology:<5} {row['ranks']:>6} {'yes' if row['secure'] else 'no':>5} "
              f"{row['rounds']:>6} {row['median_s'] * 1e3:>10.2f} {row['p90_s'] * 1e3:>8.2f} "
              f"{row['phase_median_s']['PAUSING'] * 1e3:>7.1f} {row['phase_median_s']['ROLLBACK'] * 1e3:>7.1f} "
              f"{row['phase_median_s']['RESUMING'] * 1e3:>7.1f} {row['controller_cpu_median_s'] * 1e3:>8.1f} "
              f"{rss:>7} {row['median_s'] * 1e6 / row['ranks']:>8.1f} {growth:>22} "
              + (f"{row['floor_median_s'] * 1e3:>12.2f} {floor_growth:>12} "
                 f"{row['median_s'] / row['floor_median_s']:>7.2f}"
                 if row.get("floor_median_s") else f"{'':>12} {'':>12} {'':>7}"))
        previous = row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds")
    parser.add_argument("--real-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1, help="runs per simulated size, each next to its "
                        "own floor run (min/median/max over the runs)")
    parser.add_argument("--sim-sizes", type=_sizes, help="simulated rank counts, comma-separated "
                        f"(default {','.join(map(str, SIM_SIZES))}; --quick: 64,256)")
    parser.add_argument("--relay-sizes", type=_sizes, help="rank counts behind simulated node agents that "
                        f"relay them, comma-separated (default {','.join(map(str, RELAY_SIZES))}; --quick: 64; "
                        "0: none)")
    parser.add_argument("--nproc", type=int, default=NPROC, help=f"ranks per simulated node (default {NPROC})")
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"where the JSON goes (default {RESULTS})")
    parser.add_argument("--real-sizes", type=_sizes, help="real rank counts, comma-separated "
                        "(default 2,4,8,16; --quick: 2,4; 0: none)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.real_rank:
        real_rank_main(args.rounds)
        return

    import logging
    import tempfile
    logging.basicConfig(level=logging.ERROR)
    real_sizes = args.real_sizes if args.real_sizes is not None else [2, 4] if args.quick else [2, 4, 8, 16]
    real_sizes = [n for n in real_sizes if n > 0]
    sim_sizes = [n for n in args.sim_sizes or ([64, 256] if args.quick else SIM_SIZES) if n > 0]
    relay_sizes = args.relay_sizes if args.relay_sizes is not None else [64] if args.quick else RELAY_SIZES
    relay_sizes = [n for n in relay_sizes if n > 0]
    # The controller and a worker hold one connection per rank of the star, one per node of the relays.
    ensure_descriptors(max([*sim_sizes, *(-(-n // args.nproc) for n in relay_sizes)], default=0))
    rows: list[dict] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for n in real_sizes:
            rows.append(run_real(n, 5 if args.quick else 20, False, Path(tmp)))
            print_progress(rows[-1])
        for n in sim_sizes:
            for repeat in range(args.repeat):  # each mindft run next to its floor: same machine load
                rows.append(run_sim(n, 3 if args.quick else sim_rounds(n), False, Path(tmp)))
                print_progress(rows[-1])
                floor = run_floor(n, 3 if args.quick else sim_rounds(n))
                rows[-1].update(floor_median_s=floor["median_s"], floor_all_s=floor["all_s"], repeat=repeat,
                                loadavg=os.getloadavg())
                print(f"  raw zmq floor n={n:<5} median {floor['median_s'] * 1e3:8.2f} ms  "
                      f"(load {rows[-1]['loadavg'][0]:.1f})", flush=True)
        for n in relay_sizes:
            for repeat in range(args.repeat):
                rounds = 3 if args.quick else sim_rounds(n)
                rows.append(run_relay(n, args.nproc, rounds, False, Path(tmp)))
                print_progress(rows[-1])
                floor = run_floor(n, rounds, args.nproc)
                rows[-1].update(floor_median_s=floor["median_s"], floor_all_s=floor["all_s"], repeat=repeat,
                                loadavg=os.getloadavg())
                print(f"  raw zmq floor n={n:<5} ({rows[-1]['nodes']} nodes of {args.nproc}) median "
                      f"{floor['median_s'] * 1e3:8.2f} ms  (load {rows[-1]['loadavg'][0]:.1f})", flush=True)
        # Side by side: the cost of CurveZMQ at the largest real size and a mid simulated size.
        if real_sizes:
            rows.append(run_real(real_sizes[-1], 5 if args.quick else 20, True, Path(tmp)))
            print_progress(rows[-1])
        if 256 in sim_sizes:
            rows.append(run_sim(256, 3 if args.quick else 5, True, Path(tmp)))
            print_progress(rows[-1])
    print()
    print_table([r for r in rows if not r["secure"]])
    if any(r["secure"] for r in rows):
        print()
        print("CurveZMQ on vs off (same size):")
        print_table([r for r in rows if not r["secure"]
                     and (r["kind"], r["ranks"]) in {(s["kind"], s["ranks"]) for s in rows if s["secure"]}]
                    + [r for r in rows if r["secure"]])
    real16 = next((r for r in rows if r["kind"] == "real" and r["ranks"] == 16 and not r["secure"]), None)
    sim = print_repeats([r for r in rows if r["kind"] == "simulated" and r["topology"] == "star" and not r["secure"]])
    relay = print_repeats([r for r in rows if r["kind"] == "simulated" and r["topology"] == "relay"
                           and not r["secure"]], f"ranks behind node agents of {args.nproc} (relay)")
    verdicts = {}
    if real16:
        verdicts["real_16_under_50ms"] = real16["median_s"] < TARGET_REAL_16
    if 4096 in sim:
        verdicts["sim_4096_under_1s"] = sim[4096]["median_s"] < TARGET_SIM_4096
    if 16384 in sim:
        verdicts["sim_16384_under_2s"] = sim[16384]["median_s"] < TARGET_SIM_16384
    if 4096 in sim and 16384 in sim:
        growth = sim[16384]["median_s"] / sim[4096]["median_s"]
        floor_growth = sim[16384]["floor_median_s"] / sim[4096]["floor_median_s"]
        print(f"growth 4096 → 16384 ranks: mindft x{growth:.2f}, bare zmq floor x{floor_growth:.2f}")
        verdicts["growth_4096_to_16384_within_floor"] = growth <= floor_growth
    if 16384 in relay and args.nproc == NPROC:
        verdicts["relay_16384_under_300ms"] = relay[16384]["median_s"] < TARGET_RELAY_16384
    if 100000 in relay and args.nproc == NPROC:
        verdicts["relay_100000_under_1500ms"] = relay[100000]["median_s"] < TARGET_RELAY_100000
    for n in sorted(set(sim) & set(relay)):
        print(f"{n} ranks: relay {relay[n]['median_s'] * 1e3:.1f} ms, star {sim[n]['median_s'] * 1e3:.1f} ms "
              f"(x{sim[n]['median_s'] / relay[n]['median_s']:.1f})")
    for name, ok in verdicts.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "coordination", "metric": "controller-side latency of one pause→rollback→resume "
        "round (device fault event handled → last RESUME ack); floor = 3 bare broadcast+gather "
        "phases over the same sockets without mindft", "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version(), "zmq": zmq.zmq_version(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "timeouts": {"real": dataclasses.asdict(REAL_TIMEOUTS), "simulated": dataclasses.asdict(SIM_TIMEOUTS)},
        "sim_workers": SIM_WORKERS, "nproc": args.nproc, "rows": rows, "targets": verdicts}, indent=2))
    print(f"wrote {args.output}")


def ensure_descriptors(ranks: int) -> None:
    """Raise the open-file limit (inherited by the workers) for ``ranks`` sockets, or say why not."""
    import resource
    # The controller holds one TCP connection per rank, a worker one per rank it simulates.
    needed = ranks + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"{ranks} simulated ranks need ~{needed} open files; the hard limit (ulimit -Hn) "
                         f"is {hard}: raise it or pick smaller --sim-sizes")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def sim_rounds(n: int) -> int:
    """Rounds per simulated size: fewer where one round costs seconds of a 2-core box."""
    return 10 if n <= 256 else 5 if n <= 4096 else 3


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 0 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of rank counts (e.g. 4096,16384)")
    return sizes


def print_repeats(rows: list[dict], what: str = "simulated ranks") -> dict[int, dict]:
    """Per simulated size, over its runs: min/median/max of the run medians, mindft and floor
    side by side; returns one row per size holding the medians (for the targets)."""
    sizes = sorted({r["ranks"] for r in rows})
    if not sizes:
        return {}
    print()
    print(f"{what} over runs: min / median / max of each run's median")
    print(f"{'ranks':>6} {'runs':>4} {'mindft ms':>26} {'bare zmq floor ms':>26} {'mindft / floor':>20}")
    merged = {}
    for n in sizes:
        runs = [r for r in rows if r["ranks"] == n]
        ours = sorted(r["median_s"] for r in runs)
        floor = sorted(r["floor_median_s"] for r in runs)
        ratio = sorted(r["median_s"] / r["floor_median_s"] for r in runs)

        def spread(values: list[float], scale: float = 1e3, digits: int = 1) -> str:
            return " / ".join(f"{v * scale:.{digits}f}" for v in (values[0], statistics.median(values), values[-1]))
        print(f"{n:>6} {len(runs):>4} {spread(ours):>26} {spread(floor):>26} {spread(ratio, 1, 2):>20}")
        merged[n] = {"median_s": statistics.median(ours), "floor_median_s": statistics.median(floor)}
    return merged


def print_progress(row: dict) -> None:
    print(f"  {row['kind']:<9} {row['topology']:<5} n={row['ranks']:<6} curve={'yes' if row['secure'] else 'no '} "
          f"median {row['median_s'] * 1e3:8.2f} ms  min {row['min_s'] * 1e3:8.2f}  max {row['max_s'] * 1e3:8.2f}"
          + (f"  heartbeats in the rounds: {row['heartbeat_share_in']:.1%} of frames in, "
             f"{row['heartbeat_share_out']:.1%} out (whole run: {row['heartbeat_share_in_whole_run']:.1%}, "
             f"{row['heartbeat_share_out_whole_run']:.1%})" if "heartbeat_share_in" in row else ""), flush=True)


if __name__ == "__main__":
    main()
