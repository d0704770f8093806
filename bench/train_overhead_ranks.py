"""What mindft costs a training step at 1, 2 or 4 ranks on one node, launched as users launch it.

Each rank trains the same MLP with Adam (``--width 4096``: 25.2M parameters, 288 MiB of weights
and moments, as ``bench/train_overhead.py``) in MindSpore PyNative mode on CPU, with a
hand-written loop. Every job runs under ``mindft-launch --nproc N``; the two modes differ only
in ``MS_ENABLE_TFT``:

- ``plain``: unset. mindft-launch then runs the ranks as msrun would (no controller, no
  snapshots) and the rank script calls its step function directly: no mindft at all;
- ``mindft``: ``'{RSC:1}'``, the default overhead budget (``MINDFT_OVERHEAD_BUDGET`` and
  ``MINDFT_SNAPSHOT_EVERY`` unset: the controller chooses the cadence), the rank wraps its
  step in ``FaultTolerantLoop.step``; the ranks' snapshots live in the node agent's shared
  memory, and on one node no replica is pushed.

With ``--dp on`` the ranks form MindSpore's cluster (``init()``, MCCL) and all-reduce the
gradients every step (``nn.DistributedGradReducer``); mindft then holds each rank at the step
boundary until every rank finished the step (lockstep), as it does for any job with
collectives. With ``--dp off`` (``--no-scheduler``) the ranks train independently.

The jobs alternate plain / mindft, in ABBA order round after round, so a slow drift of the
machine's speed affects both modes alike; the overhead of a round is the ratio of the two
jobs' step times. ``--modes plain mindft coordination`` adds a third mode, mindft with step 0
alone snapshotted (``MINDFT_SNAPSHOT_EVERY`` = 1000000): the cost of the flow itself (the
processor, the reports, the lockstep), apart from the snapshots; the modes then rotate so that
each runs in every position equally often over 6 rounds (in ABBA order one of three modes
would always run in the middle). ``control`` is a second unprotected job, exactly as ``plain``:
its ratio to ``plain`` in the same round is what this machine's noise alone makes of a ratio,
and mindft is also set against the mean of the round's two unprotected jobs. ``metrics`` is
mindft with ``--metrics-port``, its ``/metrics`` and status page's ``status.json`` read every
second while it trains (Prometheus scrapes every 15-60 s): set against mindft in the same round. A job's step
time is the mean over its ranks of each rank's mean step time over ``--steps`` steps after
``--warmup`` steps (the budget has chosen its cadence by then: the rank reports the step its
cadence settled at); the mindft window includes the wait for its last capture.
Memory: each rank's peak RSS (``VmHWM``, which counts the agent's shared memory it maps),
the launcher's (the node agent and the controller), the snapshot files the agent held, and
the whole job's PSS sampled every 2 s, every 0.25 s on several nodes (``--pss-every``; every
process of every launcher's tree; a shared page counts once, split among the processes that
map it); the increase over the plain job is given in units of the rank's state.

Where the CPU goes: each rank records each thread's CPU per step after the warm-up
(MindSpore's threads by their names, mindft's by theirs), and the driver each process's CPU
over the job (the launcher with the node agent and the controller, MindSpore's scheduler,
the ranks).

One command per table of the README (batch 64 and 256, with and without all-reduce; the
budget snapshots every 14–82 steps there, so 220 steps hold whole snapshot periods)::

    python bench/train_overhead_ranks.py --nproc 2 --width 2048 --rounds 2 --steps 220
    python bench/train_overhead_ranks.py --nproc 4 --width 1024 --rounds 2 --steps 220

and the job's memory with the node agents replicating (two launchers on loopback)::

    python bench/train_overhead_ranks.py --nproc 1 --nnodes 2 --width 2048 --rounds 1 --steps 150 --dp off on --batch-sizes 64
    python bench/train_overhead_ranks.py --nproc 4 --nnodes 2 --width 1024 --rounds 1 --steps 150 --dp on --batch-sizes 64

(the node agents' end-of-job lines say what each keeper received and what it pointed into
its own ranks' snapshots instead: all of a data-parallel replica)

Options: ``--batch-sizes 64 256``, ``--dp off on``, ``--rounds 3``, ``--steps``, ``--warmup``,
``--width``; results in ``bench/results/train_overhead_ranks-<N>.json``.
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
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from _common import free_port_pair  # bench/ is the script's directory
from mindft.observe.procfs import proportional_set_size
from mindft.observe.units import size_from_text
from mindft.observe.threadcpu import stat_cpu_seconds

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
IN_OUT = 1024
RANK_VARIABLE = "BENCH_RANKS_OUT"
TARGET = 1.03
MODES = ("plain", "mindft", "coordination", "control", "metrics")
SCRAPE_SECONDS = 1.0  # the metrics mode's scrapes of /metrics and /status.json (Prometheus: every 15-60 s)
NO_SNAPSHOTS = 1_000_000  # the coordination mode's MINDFT_SNAPSHOT_EVERY: step 0 alone is snapshotted
JOB_ATTEMPTS = 3  # a job that fails is run again (recorded in its "attempts")
RESULTS_GRACE = 5.0  # seconds the launcher may linger once every rank wrote its results


def whole_periods(captures: Sequence[int], warmup: int, total: int) -> Tuple[int, int]:
    """The measured window, steps ``first`` to ``last`` (1-based, inclusive): whole snapshot
    periods, so that it holds as many captures as the cadence gives its length, wherever they
    fall. A capture at the end of step c costs in step c (the call) and in step c + 1 (the copy
    overlapped with it): from the step after the first capture past the warm-up to the last
    capture before the end, each capture but the last is counted whole. Fewer than two such
    captures: every step past the warm-up (the caller flags it)."""
    captured = [c for c in captures if warmup < c < total]
    return (captured[0] + 1, captured[-1]) if len(captured) >= 2 else (warmup + 1, total)


def _status(pid: str = "self") -> Dict[str, int]:
    """Memory lines of /proc/PID/status in bytes (VmHWM, VmRSS, RssAnon, RssFile, RssShmem)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _budget_estimate(session: Any) -> Tuple[float, bool]:
    """The controller's estimate of what snapshots cost at the cadence it chose, and whether that
    is over the budget (``mindft status`` shows the same)."""
    from mindft.net.channel import request
    from mindft.protocol import StatusRequest

    status = request(session.config.controller_address, session._keys, StatusRequest(), 10.0)
    return status.snapshot_cost, status.over_budget


def rank_main() -> None:
    """One rank: train, time every step, write the figures to $BENCH_RANKS_OUT/rank<R>.json."""
    # Not bench/ on the path: MindSpore imports a module named mindio if it can (bench/mindio.py is one).
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    width, batch, warmup, steps, dp = (int(os.environ[f"BENCH_RANKS_{name}"])
                                       for name in ("WIDTH", "BATCH", "WARMUP", "STEPS", "DP"))
    protected = bool(os.environ.get("MS_ENABLE_TFT"))
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    rank = int(os.environ.get("RANK_ID", "0"))
    if dp:
        from mindspore.communication import init

        init()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(0)
    net = nn.SequentialCell(nn.Dense(IN_OUT, width), nn.ReLU(), nn.Dense(width, width), nn.ReLU(),
                            nn.Dense(width, IN_OUT))
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-4)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)
    reducer = nn.DistributedGradReducer(optimizer.parameters) if dp else None
    rng = np.random.default_rng(rank)
    x = ms.Tensor(rng.random((batch, IN_OUT), dtype=np.float32))
    y = ms.Tensor(rng.random((batch, IN_OUT), dtype=np.float32))

    def train_step(xb: Any, yb: Any) -> None:
        loss, grads = grad_fn(xb, yb)
        if reducer is not None:
            grads = reducer(grads)
        optimizer(grads)
        loss.asnumpy()  # wait for the step's kernels

    # What mindft snapshots: the network's parameters and the optimizer's (its moments), each once.
    state = {p.name: p for p in (*net.get_parameters(), *optimizer.get_parameters())}
    state_bytes = sum(p.asnumpy().nbytes for p in state.values())
    total = warmup + steps
    times: List[float] = []  # wall time of each step
    cpus: List[float] = []  # CPU time of the process (every thread) during each step
    result: Dict[str, Any] = {"rank": rank, "protected": protected, "state_bytes": state_bytes}
    if not protected:
        for step in range(1, total + 1):
            if step == warmup + 1:
                threads_before = _thread_cpu()
            started, cpu_started = time.perf_counter(), time.process_time()
            train_step(x, y)
            times.append(time.perf_counter() - started)
            cpus.append(time.process_time() - cpu_started)
        threads_after = _thread_cpu()
        first, last = warmup + 1, total  # the window: steps first..last
    else:
        from mindft.mindspore import FaultTolerantLoop

        # Where a protected step's time goes (bench-only instrumentation, same calls): the
        # training itself, the optimizer's wait for a capture still copying, the wait for the
        # other ranks (lockstep) or for the window, the capture call.
        parts: Dict[str, List[float]] = {"train": [], "hook_wait": [], "wait_peers": [], "wait_window": [],
                                         "capture": []}

        def timed(name: str, fn: Any) -> Any:
            def call(*args: Any) -> Any:
                started = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    parts[name][-1] += time.perf_counter() - started
            return call

        def protected_step(xb: Any, yb: Any) -> None:
            started = time.perf_counter()
            train_step(xb, yb)
            # _hook_wait: the optimizer's wait for a capture, and the wait for the peers when it
            # happens in the hook before the collectives (counted under wait_peers)
            parts["hook_wait"][-1] = session._hook_wait - parts["wait_peers"][-1]
            parts["train"][-1] = time.perf_counter() - started - session._hook_wait

        with FaultTolerantLoop(net, optimizer) as loop:
            session = loop.session
            processor = session.processor
            processor.wait_peers = timed("wait_peers", processor.wait_peers)
            processor.wait_window = timed("wait_window", processor.wait_window)
            session._capture = timed("capture", session._capture)
            for step, _ in loop.batches(lambda step: None, total):
                for values in parts.values():
                    values.append(0.0)
                if step == warmup + 1:
                    threads_before = _thread_cpu()
                started, cpu_started = time.perf_counter(), time.process_time()
                loop.step(protected_step, x, y)
                if step == total:
                    session.store.wait()  # the last step pays for its capture's copy
                    result["memory"] = _status()  # while the snapshots are still mapped
                    threads_after = _thread_cpu()  # while mindft's threads still run
                    result["budget"] = _budget_estimate(session)
                times.append(time.perf_counter() - started)
                cpus.append(time.process_time() - cpu_started)
            result["parts"] = parts
            schedule = session.processor.follower.schedule
            captured = [c for c in range(warmup + 1, total) if schedule.is_capture(c)]
            first, last = whole_periods(captured, warmup, total)
            result.update(segments=[list(s) for s in schedule.segments], whole_periods=len(captured) >= 2,
                          captures_in_window=max(len(captured) - 1, 0) if len(captured) >= 2 else sum(
                              schedule.is_capture(c) for c in range(first, last + 1)),
                          every_in_window=schedule.every_at(first),
                          store_bytes=session.store.nbytes,
                          step_cost=session.costs.step_time, capture_cost=session.costs.capture_time)
    result.setdefault("memory", _status())
    # CPU per step of each thread (by name) from the warm-up's end to the last step
    result["thread_cpu_ms"] = {name: (seconds - threads_before.get(name, 0.0)) / steps * 1e3
                               for name, seconds in threads_after.items()}
    count = last - first + 1
    result.update(times=times, cpus=cpus, window=[first, last], step_s=sum(times[first - 1:last]) / count,
                  cpu_s=sum(cpus[first - 1:last]) / count)
    if dp:
        from mindspore.communication import release

        release()  # unregister from the scheduler, which otherwise waits for this rank to time out
    out = Path(os.environ[RANK_VARIABLE])
    partial = out / f".rank{rank}.json.tmp"
    partial.write_text(json.dumps(result))
    partial.rename(out / f"rank{rank}.json")  # the driver waits for the name


def _thread_cpu(pid: str = "self") -> Dict[str, float]:
    """CPU seconds of each of the process's threads so far, summed by thread name (Python's
    own name for a Python thread)."""
    out: Dict[str, float] = {}
    python = {str(t.native_id): t.name for t in threading.enumerate()}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = python.get(task.name) or (task / "comm").read_text().strip()
            seconds = stat_cpu_seconds(task / "stat")
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def _load() -> List[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _pss(pid: int) -> int:
    """The process's proportional set size in bytes: each shared page counts 1/n in each of its n
    mappers, so a sum over processes counts the agent's shared memory once."""
    return proportional_set_size(pid) or 0


def _tree(pid: int) -> List[int]:
    """``pid`` and every process below it (ranks, controller, scheduler, started by a launcher)."""
    children: Dict[int, List[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], ()))
    return tree


def _process(pid: int) -> Optional[tuple]:
    """(what the process is, its CPU seconds so far): the launcher, a rank, MindSpore's scheduler."""
    try:
        seconds = stat_cpu_seconds(Path(f"/proc/{pid}/stat"))
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"mindft.cli.launch" in command:
        kind = "launcher"
    elif b"MS_ROLE=MS_SCHED" in environ:
        kind = "scheduler"
    elif any(part.endswith(b"train_overhead_ranks.py") for part in command):
        kind = "rank"
    else:
        kind = Path(command[0].decode(errors="replace")).name
    return kind, seconds


class _Sampler:
    """Samples the launchers' memory, the whole job's (PSS: shared memory counted once) and the
    size of the agents' snapshot files while a job runs.

    PSS is read every ``pss_seconds`` (rounded to whole ticks): the kernel walks every page of
    a process for it, ~10 ms of CPU per rank of 600 MiB on this VM, a fifth of a core taken from
    the job at every tick. On one node the peak lasts (the double buffer stays once allocated): every 2 s. With
    replicas (several nodes) the peak is the old replica and the new one while it arrives:
    every tick."""

    TICK = 0.25

    def __init__(self, pids: List[int], pss_seconds: float) -> None:
        self.pss_every = max(1, round(pss_seconds / self.TICK))  # ticks
        self.pids = pids
        self.launchers: List[Dict[str, int]] = [{} for _ in pids]
        self.shm_peak = 0
        self.pss_peak = 0
        self.cpu: Dict[int, tuple] = {}  # pid: (kind, CPU seconds at its last sample)
        self._known = set(Path("/dev/shm").glob("mindft-state-*")) if Path("/dev/shm").is_dir() else set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(self.TICK):
            tick += 1
            for index, pid in enumerate(self.pids):
                status = _status(str(pid))
                if status:
                    self.launchers[index] = status
            shm = 0
            for directory in Path("/dev/shm").glob("mindft-state-*"):
                if directory in self._known:
                    continue
                try:
                    shm += sum(f.stat().st_blocks * 512 for f in directory.rglob("*") if f.is_file())
                except OSError:
                    pass
            self.shm_peak = max(self.shm_peak, shm)
            tree = [p for launcher in self.pids for p in _tree(launcher)]
            if (tick - 1) % self.pss_every == 0:
                self.pss_peak = max(self.pss_peak, sum(_pss(p) for p in tree))
            for pid in tree:
                sample = _process(pid)
                if sample is not None:
                    self.cpu[pid] = sample

    def cpu_by_kind(self) -> Dict[str, float]:
        """CPU seconds each kind of process used over the job (as last sampled)."""
        out: Dict[str, float] = {}
        for kind, seconds in self.cpu.values():
            out[kind] = out.get(kind, 0.0) + seconds
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class JobFailed(RuntimeError):
    """A job did not finish: the launcher's exit code and the end of its output."""


def _ephemeral_port() -> int:
    """A free port the kernel picks, in its ephemeral range, where mindft-launch picks none of its own."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Scraper:
    """Reads http://127.0.0.1:PORT/metrics and /status.json every :data:`SCRAPE_SECONDS` while a
    job runs, as Prometheus and an open status page would (far more often than Prometheus)."""

    def __init__(self, port: int) -> None:
        self.port, self.scrapes = port, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request
        while not self._stop.wait(SCRAPE_SECONDS):
            try:
                for path in ("metrics", "status.json"):
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/{path}", timeout=5) as answer:
                        answer.read()
                self.scrapes += 1
            except OSError:
                pass  # not serving yet, or done

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _wait_job(launchers: List[subprocess.Popen], results: List[Path], timeout: float) -> Optional[int]:
    """The launchers' worst exit code; 0 once every rank wrote its results and a launcher lingers.

    A rank that called init() exits without unregistering from MindSpore's scheduler, which then
    waits ~25 s for it to time out (after the measured window, whatever the mode): not worth waiting for.
    """
    deadline = time.monotonic() + timeout
    done_at: Optional[float] = None
    while time.monotonic() < deadline:
        codes = [launcher.poll() for launcher in launchers]
        if any(code for code in codes):
            return max(code for code in codes if code is not None)
        if all(code == 0 for code in codes):
            return 0
        if done_at is None and all(path.exists() for path in results):
            done_at = time.monotonic()
        if done_at is not None and time.monotonic() - done_at > RESULTS_GRACE:
            return 0
        time.sleep(0.2)
    return None


def run_job(mode: str, nproc: int, batch: int, dp: bool, args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    out = work / f"{mode}-b{batch}-dp{int(dp)}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    nnodes, world = args.nnodes, nproc * args.nnodes
    env = dict(os.environ, PYTHONPATH=str(REPO), **{RANK_VARIABLE: str(out)},
               BENCH_RANKS_WIDTH=str(args.width), BENCH_RANKS_BATCH=str(batch),
               BENCH_RANKS_WARMUP=str(args.warmup), BENCH_RANKS_STEPS=str(args.steps),
               BENCH_RANKS_DP=str(int(dp)), MINDFT_RESET_FILE=str(work / "reset.json"),
               MINDFT_REGISTER_TIMEOUT="600", MINDFT_DUMP_DIR=str(out / "dump"))
    for name in ("MS_ENABLE_TFT", "MINDFT_SNAPSHOT_EVERY", "MINDFT_OVERHEAD_BUDGET", "MINDFT_KEY_FILE",
                 "MINDFT_INSECURE", "MS_TFT_PORT", "MINDFT_REPLICA_BUDDY", "MINDFT_STATE_DIR"):
        env.pop(name, None)
    if mode in ("mindft", "coordination", "metrics"):
        env["MS_ENABLE_TFT"] = "{RSC:1}"
    if mode == "coordination":
        env["MINDFT_SNAPSHOT_EVERY"] = str(NO_SNAPSHOTS)
    command = [sys.executable, "-m", "mindft.cli.launch", "--nproc", str(nproc), *([] if dp else ["--no-scheduler"])]
    scraper = None
    if mode == "metrics":
        port = _ephemeral_port()
        command += ["--metrics-port", str(port), "--metrics-addr", "127.0.0.1"]
        scraper = _Scraper(port)
    if nnodes > 1:
        # Several nodes on loopback: one launcher (node agent) each, as on separate machines.
        command += ["--nnodes", str(nnodes), "--master-addr", "127.0.0.1",
                    "--master-port", str(free_port_pair())]
        if mode == "mindft":
            command += ["--key-file", str(work / "keys.json")]
    load_before = _load()
    started = time.monotonic()
    launchers, logs = [], [out / f"node{node}.out" for node in range(nnodes)]
    try:
        for node in reversed(range(nnodes)):
            with open(logs[node], "wb") as log:
                launchers.append(subprocess.Popen(
                    [*command, *(["--node-rank", str(node)] if nnodes > 1 else []), "--run-dir",
                     str(out / f"run{node}"), __file__], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
        sampler = _Sampler([launcher.pid for launcher in launchers],
                           pss_seconds=args.pss_every or (_Sampler.TICK if nnodes > 1 else 2.0))
        try:
            code = _wait_job(launchers, [out / f"rank{r}.json" for r in range(world)], args.timeout)
        finally:
            sampler.stop()
            if scraper is not None:
                scraper.stop()
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGTERM)  # it stops its ranks and the scheduler
        for launcher in launchers:
            try:
                launcher.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    text = "\n".join(path.read_text(errors="replace") for path in logs)
    if code != 0:
        raise JobFailed(f"mindft-launch exited {code}:\n{text[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    sent = [int(n) for n in re.findall(r"replication: sent (\d+) replica", text)]
    kept = re.findall(r"received (.+?), shared (.+?) with this node's snapshots", text)
    job = {"mode": mode, "batch": batch, "dp": dp, "nproc": nproc, "nnodes": nnodes,
           "replicas_sent": sum(sent) if sent else None, "lost_protection": text.count("LOST PROTECTION"),
           "replica_bytes": [[size_from_text(received), size_from_text(shared)] for received, shared in kept],
           "replicas_spilled": sum(int(n) for n in re.findall(r"(\d+) moved to disk while the next arrived", text)),
           "step_ms": statistics.fmean(r["step_s"] for r in ranks) * 1e3,
           "per_rank_ms": [r["step_s"] * 1e3 for r in ranks], "times": [r["times"] for r in ranks],
           "cpu_ms": statistics.fmean(r["cpu_s"] for r in ranks) * 1e3,
           "state_bytes": ranks[0]["state_bytes"],
           "rank_hwm": [r["memory"].get("VmHWM", 0) for r in ranks],
           "rank_memory": [r["memory"] for r in ranks],
           "launcher_hwm": [status.get("VmHWM", 0) for status in sampler.launchers], "shm_peak": sampler.shm_peak,
           "job_pss_peak": sampler.pss_peak, "job_cpu_s": sampler.cpu_by_kind(),
           "thread_cpu_ms": {name: statistics.fmean(r["thread_cpu_ms"].get(name, 0.0) for r in ranks)
                             for name in sorted({n for r in ranks for n in r["thread_cpu_ms"]})},
           "seconds": time.monotonic() - started, "load_before": load_before, "load_after": _load()}
    if mode == "mindft":
        job.update(segments=[r["segments"] for r in ranks], every=ranks[0]["every_in_window"],
                   whole_periods=all(r["whole_periods"] for r in ranks), windows=[r["window"] for r in ranks],
                   settled_at=max(start for r in ranks for start, _ in r["segments"]
                                  if start <= args.warmup + args.steps),
                   captures_in_window=[r["captures_in_window"] for r in ranks],
                   # CPU per step of mindft's own threads (snapshot copy, processor, ZeroMQ I/O)
                   mindft_threads_ms=sum(ms for name, ms in job["thread_cpu_ms"].items()
                                         if name.startswith(("mindft", "ZMQbg"))),
                   step_cost_ms=[(r["step_cost"] or 0) * 1e3 for r in ranks],
                   capture_cost_ms=[(r["capture_cost"] or 0) * 1e3 for r in ranks],
                   # ms per step in the window, mean over ranks: training, and mindft's waits
                   parts_ms={name: statistics.fmean(statistics.fmean(r["parts"][name][r["window"][0] - 1:r["window"][1]])
                                                    for r in ranks) * 1e3 for name in ranks[0]["parts"]},
                   # What the budget itself expects (the controller's figure: the slowest rank's
                   # capture plus the busiest node's replication CPU, over N steps' time)
                   expected_overhead=max(r["budget"][0] for r in ranks),
                   over_budget=any(r["budget"][1] for r in ranks))
        if not job["whole_periods"]:
            print(f"  note: fewer than two snapshots after the warm-up (every {job['every']} steps): the "
                  f"window is not whole snapshot periods; raise --steps", flush=True)
    return job


def orders(modes: Sequence[str]) -> List[List[str]]:
    """The order of the modes round after round: the rotations of ``modes``, then those of the
    reversed modes, so every mode runs in every position, after every other, equally often
    (two modes: ABBA)."""
    modes = list(modes)
    return [modes[i:] + modes[:i] for i in range(len(modes))] + [
        modes[::-1][i:] + modes[::-1][:i] for i in range(len(modes))]


def summarize(jobs: List[Dict[str, Any]], batch: int, dp: bool) -> Dict[str, Any]:
    mine = [j for j in jobs if j["batch"] == batch and j["dp"] == dp]
    by = {(j["round"], j["mode"]): j for j in mine}
    modes = sorted({j["mode"] for j in mine})
    rounds = sorted({j["round"] for j in mine if all((j["round"], mode) in by for mode in modes)})
    ratios = [by[(r, "mindft")]["step_ms"] / by[(r, "plain")]["step_ms"] for r in rounds]
    state = mine[0]["state_bytes"]

    def spread(values: List[float]) -> List[float]:
        return [min(values), statistics.median(values), max(values)]

    rank_extra = [max(p - q for p, q in zip(by[(r, "mindft")]["rank_hwm"], by[(r, "plain")]["rank_hwm"]))
                  for r in rounds]
    launcher_extra = [sum(by[(r, "mindft")]["launcher_hwm"]) - sum(by[(r, "plain")]["launcher_hwm"]) for r in rounds]
    world = mine[0]["nproc"] * mine[0]["nnodes"]
    # Every process's peak (ranks and node agents; shared memory counts in whichever maps it),
    # protected over plain, per rank, in units of the rank's state: an upper bound (the peaks
    # need not coincide).
    job_extra = [(sum(by[(r, "mindft")]["rank_hwm"]) + sum(by[(r, "mindft")]["launcher_hwm"])
                  - sum(by[(r, "plain")]["rank_hwm"]) - sum(by[(r, "plain")]["launcher_hwm"])) / world / state
                 for r in rounds]
    # The same from the job's sampled PSS (every process of every launcher's tree, shared pages
    # counted once): what the job holds, not an upper bound.
    job_extra_pss = [(by[(r, "mindft")]["job_pss_peak"] - by[(r, "plain")]["job_pss_peak"]) / world / state
                     for r in rounds]
    loads = [by[(r, m)][key][0] for r in rounds for m in modes for key in ("load_before", "load_after")]
    # The other modes against plain (the flow alone; the noise alone), and mindft against the flow alone.
    others = {f"{mode}_ratio": spread([by[(r, mode)]["step_ms"] / by[(r, "plain")]["step_ms"] for r in rounds])
              for mode in modes if mode not in ("plain", "mindft")}
    if "coordination" in modes:
        others["mindft_over_coordination"] = spread([by[(r, "mindft")]["step_ms"] / by[(r, "coordination")]["step_ms"]
                                                     for r in rounds])
    if "metrics" in modes:
        others["metrics_over_mindft"] = spread([by[(r, "metrics")]["step_ms"] / by[(r, "mindft")]["step_ms"]
                                                for r in rounds])
    if "control" in modes:
        others["mindft_over_unprotected"] = spread([2 * by[(r, "mindft")]["step_ms"] / (
            by[(r, "plain")]["step_ms"] + by[(r, "control")]["step_ms"]) for r in rounds])
    return {"batch": batch, "dp": dp, "rounds": len(rounds), **others,
            "plain_ms": spread([by[(r, "plain")]["step_ms"] for r in rounds]),
            "mindft_ms": spread([by[(r, "mindft")]["step_ms"] for r in rounds]),
            "ratio": spread(ratios), "every": [by[(r, "mindft")]["every"] for r in rounds],
            "expected_overhead": spread([by[(r, "mindft")].get("expected_overhead", 0) for r in rounds]),
            "cpu_ratio": spread([by[(r, "mindft")]["cpu_ms"] / by[(r, "plain")]["cpu_ms"] for r in rounds]),
            # mindft's own time on the training thread, ms per step (median over rounds)
            "parts_ms": {name: statistics.median(by[(r, "mindft")]["parts_ms"][name] for r in rounds)
                         for name in by[(rounds[0], "mindft")]["parts_ms"]},
            "state_bytes": state,
            # The worst rank's peak RSS over the plain job's, in units of the rank's state
            # (the agent's shared memory the rank maps counts in its RSS).
            "rank_extra_state": spread([e / state for e in rank_extra]),
            "launcher_extra_mb": spread([e / 2**20 for e in launcher_extra]),
            "job_extra_state": spread(job_extra),
            "job_extra_pss_state": spread(job_extra_pss),
            "shm_per_rank_state": spread([by[(r, "mindft")]["shm_peak"] / world / state for r in rounds]),
            "load_1min": [min(loads), max(loads)]}


def _job_memory(row: Dict[str, Any]) -> List[float]:
    """The job's peak memory over plain per rank, in states: PSS where the run sampled it (older
    runs: the sum of every process's peak RSS, an upper bound)."""
    return row.get("job_extra_pss_state") or row["job_extra_state"]


def markdown(rows: List[Dict[str, Any]]) -> str:
    """The README's table for one rank count, from a run's rows."""
    def spread(values: List[float], digits: int = 1) -> str:
        return " / ".join(f"{v:.{digits}f}" for v in values)
    lines = ["| batch | all-reduce | plain step, ms | mindft step, ms | **ratio** | N chosen | budget's estimate "
             "| CPU ratio | mindft's wait per step | job memory over plain, × state per rank | load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        waits = r["parts_ms"]
        wait = waits["wait_peers"] + waits["wait_window"] + waits["hook_wait"] + waits["capture"]
        lines.append(f"| {r['batch']} | {'yes' if r['dp'] else 'no'} | {spread(r['plain_ms'])} | "
                     f"{spread(r['mindft_ms'])} | **{spread(r['ratio'], 3)}** | {', '.join(map(str, r['every']))} | "
                     f"{' / '.join(f'{v:.1%}' for v in r.get('expected_overhead', []))} | "
                     f"{spread(r['cpu_ratio'], 3)} | {wait:.1f} ms | {spread(_job_memory(r), 2)} | "
                     f"{r['load_1min'][0]:.1f}–{r['load_1min'][1]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per node")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="nodes, played by one mindft-launch each on 127.0.0.1 (the agents replicate)")
    parser.add_argument("--width", type=int, default=4096, help="hidden width (4096: 25.2M parameters, 2048: 8.4M)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--dp", nargs="+", choices=("off", "on"), default=["off", "on"],
                        help="without / with the gradient all-reduce")
    parser.add_argument("--rounds", type=int, default=3, help="plain/mindft pairs per configuration")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the measured window")
    parser.add_argument("--steps", type=int, default=60, help="steps in the measured window")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["plain", "mindft"],
                        help="coordination: mindft with step 0 alone snapshotted (the flow's own cost); "
                             "control: a second plain job (the noise of a ratio)")
    parser.add_argument("--pss-every", type=float, default=None, metavar="SECONDS",
                        help="how often the whole job's PSS is read (default 2, 0.25 on several nodes to catch the "
                             "replicas' peak; reading it takes CPU from the job, more from the protected one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--table", type=Path, metavar="JSON",
                        help="print the README's table from a recorded run (its JSON) and exit")
    args = parser.parse_args()
    if args.pss_every is not None and args.pss_every < _Sampler.TICK:
        parser.error(f"--pss-every must be at least {_Sampler.TICK} seconds (the sampler's tick), got {args.pss_every}")
    if args.table:
        recorded = json.loads(args.table.read_text())
        jobs = recorded["jobs"]
        for job in jobs:  # runs recorded before --nnodes
            job.setdefault("nnodes", 1)
            if not isinstance(job["launcher_hwm"], list):
                job["launcher_hwm"] = [job["launcher_hwm"]]
        configs = sorted({(j["batch"], j["dp"]) for j in jobs}, key=lambda c: (c[1], c[0]))
        print(markdown([summarize(jobs, batch, dp) for batch, dp in configs]))
        return
    output = args.output or RESULTS / f"train_overhead_ranks-{args.nproc}{f'x{args.nnodes}' if args.nnodes > 1 else ''}.json"
    configs = [(batch, dp == "on") for dp in args.dp for batch in args.batch_sizes]
    jobs: List[Dict[str, Any]] = []
    load_start = _load()
    # SIGTERM ends the run like Ctrl-C: the jobs' launchers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    import mindspore  # only for the version in the record

    def record(rows: Optional[List[Dict[str, Any]]]) -> None:
        """The run so far (every job as it ends: a run cut short keeps what it measured)."""
        result = {"benchmark": "train_overhead_ranks", "nproc": args.nproc, "nnodes": args.nnodes,
                  "width": args.width, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
                  "pss_every": args.pss_every,
                  "target": TARGET, "cpus": os.cpu_count(), "machine": platform.platform(),
                  "python": platform.python_version(), "mindspore": mindspore.__version__,
                  "load_start": load_start, "load_end": _load(), "complete": rows is not None,
                  "rows": rows or [], "jobs": jobs}
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1))
    with tempfile.TemporaryDirectory(prefix="mindft-bench-ranks-") as tmp:
        if args.nnodes > 1:  # one job key for every node, as a user distributes it
            subprocess.run([sys.executable, "-c", "from mindft.cli.main import main; main()", "keygen",
                            str(Path(tmp) / "keys.json")], check=True, cwd=REPO, capture_output=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        for round_ in range(args.rounds):
            for batch, dp in configs:
                order = orders(args.modes)[round_ % (2 * len(args.modes))]
                for mode in order:
                    for attempt in range(1, JOB_ATTEMPTS + 1):
                        try:
                            job = run_job(mode, args.nproc, batch, dp, args, Path(tmp))
                            break
                        except JobFailed as failure:
                            # On a shared machine a job can die of something else (a stray signal).
                            print(f"round {round_} batch {batch} dp {dp} {mode}: attempt {attempt} failed: "
                                  f"{failure}", flush=True)
                            if attempt == JOB_ATTEMPTS:
                                raise SystemExit(f"giving up after {attempt} attempts") from failure
                    job["round"] = round_
                    job["attempts"] = attempt
                    jobs.append(job)
                    record(None)
                    extra = (f", every {job['every']}, window {job['windows'][0][0]}–{job['windows'][0][1]} "
                             f"({job['captures_in_window'][0]} captures), budget expects "
                             f"{job['expected_overhead']:.2%}{' (OVER BUDGET)' if job['over_budget'] else ''}, per step: " + ", ".join(
                                 f"{k} {v:.1f}" for k, v in job["parts_ms"].items()) + ", mindft's threads' CPU "
                             f"{job['mindft_threads_ms']:.2f}" if mode == "mindft" else "")
                    print(f"round {round_} batch {batch:>3} dp {'on ' if dp else 'off'} {mode:>6}: step "
                          f"{job['step_ms']:7.1f} ms (cpu {job['cpu_ms']:.1f} ms; ranks {', '.join(f'{v:.1f}' for v in job['per_rank_ms'])})"
                          f"{extra}; peak RSS {max(job['rank_hwm']) / 2**20:.0f} MiB, agents "
                          f"{', '.join(f'{v / 2**20:.0f}' for v in job['launcher_hwm'])} MiB"
                          + (f", replicas sent {job['replicas_sent']}, lost protection {job['lost_protection']}, "
                             "keepers received / shared with their own ranks " + ", ".join(
                                 f"{r / 2**20:.1f} / {s / 2**20:.1f} MiB" for r, s in job["replica_bytes"])
                             + f", {job['replicas_spilled']} replica(s) moved to disk while the next arrived"
                             if mode == "mindft" and job["nnodes"] > 1 else "") + "; load "
                          f"{job['load_before'][0]:.2f}→{job['load_after'][0]:.2f}; {job['seconds']:.0f} s",
                          flush=True)
    if not {"plain", "mindft"} <= set(args.modes):
        return  # profiling: nothing to compare
    rows = [summarize(jobs, batch, dp) for batch, dp in configs]
    record(rows)
    state = rows[0]["state_bytes"]
    where = "one node" if args.nnodes == 1 else f"each of {args.nnodes} nodes (loopback)"
    print(f"{args.nproc} rank(s) on {where}, {state / 2**20:.0f} MiB of state per rank (width {args.width}); "
          f"{args.steps} steps measured after {args.warmup}; {args.rounds} rounds; min / median / max over rounds")
    print(f"{'batch':>5} {'all-reduce':>10} {'plain ms':>20} {'mindft ms':>20} {'ratio':>20} {'N':>10} "
          f"{'cpu ratio':>20} {'wait peers ms':>13} {'rank RSS +x state':>18} {'job PSS +x state/rank':>18} "
          f"{'load 1 min':>11}")
    for r in rows:
        def fmt(v: List[float], p: int = 1) -> str:
            return " / ".join(f"{x:.{p}f}" for x in v)
        print(f"{r['batch']:>5} {'on' if r['dp'] else 'off':>10} {fmt(r['plain_ms']):>20} {fmt(r['mindft_ms']):>20} "
              f"{fmt(r['ratio'], 3):>20} {','.join(map(str, r['every'])):>10} {fmt(r['cpu_ratio'], 3):>20} "
              f"{r['parts_ms']['wait_peers']:>13.1f} {fmt(r['rank_extra_state'], 2):>18} "
              f"{fmt(_job_memory(r), 2):>18} "
              f"{r['load_1min'][0]:.1f}–{r['load_1min'][1]:.1f}")
        if "coordination_ratio" in r:
            print(f"{'':>16} coordination alone / plain {fmt(r['coordination_ratio'], 3)}, "
                  f"mindft / coordination alone {fmt(r['mindft_over_coordination'], 3)}")
        if "metrics_ratio" in r:
            print(f"{'':>16} mindft with metrics scraped every {SCRAPE_SECONDS:g} s / mindft "
                  f"{fmt(r['metrics_over_mindft'], 3)}")
        if "control_ratio" in r:
            print(f"{'':>16} control (a second plain job) / plain {fmt(r['control_ratio'], 3)}, "
                  f"mindft / the mean of plain and control {fmt(r['mindft_over_unprotected'], 3)}")
    worst = max(r["ratio"][1] for r in rows)
    print(f"worst median ratio {worst:.3f} — target <= {TARGET}: {'met' if worst <= TARGET else 'NOT met'}")
    print(f"wrote {output}; the README's table (min / median / max over rounds):")
    print(markdown(rows))


if __name__ == "__main__":
    if os.environ.get(RANK_VARIABLE):
        rank_main()
    else:
        main()
