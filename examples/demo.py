"""mindft in one command: a hot reset in the middle of training, and weights bit-identical to a run without it.

    pip install -e . && python examples/demo.py

1. trains examples/train_dp.py, data-parallel on 4 ranks (MindSpore's scheduler, MCCL
   all-reducing every step's gradients), with mindft-launch and no fault (the reference);
2. trains it again and, mid-run, plays the Ascend device plugin as its code does
   (``mindft simulate-device-plugin``): rank 2's chip is reported ``unrecovered`` in the
   reset file (reset.json, as with ``-hotReset=1``); the chip is reset only once every
   process on it has exited, then ``recovered`` is written. On CPU a restarted process
   cannot rejoin the others' all-reduce, so mindft's ladder restarts every worker from
   the node agents' memory: all leave at once, come back after ``recovered``, roll back
   to the step they all hold and resume;
3. prints the ladder's decision and a timeline (from the run's event log, as ``mindft events``
   prints it), and compares the final weights of both
   runs: exit code 0 only if they are bit-identical.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout even before `pip install -e .`

from mindft.net.keys import load_keys  # noqa: E402
from mindft.net.channel import Client, ControllerUnreachable  # noqa: E402
from mindft.observe.events import read as read_events  # noqa: E402
from mindft.observe.timeline import Recovery, recoveries, render  # noqa: E402

TRAIN = ROOT / "examples" / "train_dp.py"
RUN_TIMEOUT = 600.0
STOP_TIMEOUT = 30.0  # for a launcher to stop its ranks (its own grace period is 10 s, then SIGKILL)
# Which lines of a run to show (all with --verbose): the recovery story, not every loss value.
_SHOW = {
    "[controller]": ("state ", "fault", "recover", "failed", "finished"),
    "[mindft-launch]": ("rank(s)", "restart", "killed", "SIG", "exit 1", "exit 3", "device", "starting rank",
                        "scheduler on"),
    "[resetwatch]": ("Device", "ignored", "unreadable"),
    "[rank": ("paus", "adopted", "agent's memory", "leaves its device", "restored", "resumed", "dump", "fault",
              "Error", "Traceback"),
}


def interesting(line: str) -> bool:
    """True for the lines that tell what mindft did."""
    for prefix, words in _SHOW.items():
        if line.startswith(prefix):
            return any(word in line for word in words)
    return False


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def launcher_command(nproc: int, run_dir: Path, out: Path, epochs: int, step_seconds: float,
                     extra: list[str]) -> list[str]:
    launcher = shutil.which("mindft-launch")
    head = [launcher] if launcher else [sys.executable, "-m", "mindft.cli.launch"]
    return [*head, "--nproc", str(nproc), "--run-dir", str(run_dir), str(TRAIN),
            "--epochs", str(epochs), "--step-seconds", str(step_seconds), "--out", str(out), *extra]


class Run:
    """One mindft-launch process whose output is streamed (all of it, or only the interesting lines)."""

    started_runs: list["Run"] = []  # what Ctrl-C must stop

    def __init__(self, name: str, command: list[str], env: dict[str, str], verbose: bool) -> None:
        self.name = name
        self.lines: list[str] = []
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace", start_new_session=True)
        self._verbose = verbose
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()
        Run.started_runs.append(self)

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if self._verbose or interesting(line):
                print(f"  {self.name} | {line}", end="", flush=True)

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise SystemExit(f"[demo] {self.name} run did not finish within {timeout:g}s")
        self._thread.join(5.0)
        return code

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop the launcher; it forwards ``signum`` to every rank and waits for them."""
        if self.process.poll() is None:
            # The launcher runs in its own session (so a terminal's Ctrl-C reaches it only
            # once, from here); it stops its ranks, which run in sessions of their own.
            self.process.send_signal(signum)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


def controller_of(run_dir: Path, timeout: float) -> Client:
    """Wait for mindft-launch's job.json and connect to the controller it names."""
    deadline = time.monotonic() + timeout
    job = run_dir / "job.json"
    while time.monotonic() < deadline:
        try:
            info = json.loads(job.read_text())
            keys = None if info.get("insecure") else load_keys(Path(info["key_file"]))
            return Client(info["controller"], keys, timeout=2.0)
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    raise SystemExit(f"[demo] {job} did not appear within {timeout:g}s")


def wait_for(client: Client, run: Run, predicate, what: str, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.process.poll() is not None:
            raise SystemExit(f"[demo] the job ended (exit {run.process.returncode}) before {what}")
        try:
            status = client.status()
            if predicate(status):
                return status
        except ControllerUnreachable:
            pass
        time.sleep(0.05)
    raise SystemExit(f"[demo] timed out waiting for {what}")


def hot_reset(job_file: Path, rank: int, seconds: float, events: dict[str, float]) -> None:
    """Play the device plugin (``mindft simulate-device-plugin --job``): ``unrecovered``; the
    reset once the chip's process exited (isolated if it stays 60 s); ``recovered``."""
    command = [sys.executable, "-m", "mindft.cli.main", "simulate-device-plugin", "--job", str(job_file),
               "--rank", str(rank), "--hold", str(seconds), "--json"]
    plugin = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert plugin.stdout is not None
    for line in plugin.stdout:
        event = json.loads(line)
        if "event" not in event:  # mindft's error object: {"error": MESSAGE, ...}
            raise SystemExit(f"[demo] the device plugin simulation failed: {event.get('error', line.strip())}")
        events.setdefault(event["event"], time.time())  # wall clock, as the event log
        say(f"device plugin: rank {rank} {event['event']}"
            + (f" (pid {event['pid']})" if "pid" in event else "")
            + (f" — resetting the chip for {seconds:g}s" if event["event"] == "process left the chip" else ""))
    if plugin.wait() != 0:
        raise SystemExit("[demo] the device plugin simulation failed")


def timeline(run_dir: Path, since: float, plugin: dict[str, float]) -> tuple[list[tuple[float, str]],
                                                                          Optional[Recovery]]:
    """(seconds after ``since``, what happened) in the first recovery of ``run_dir``'s event log
    (mindft.observe.events: what ``mindft events`` reads), with the device plugin's moves; and that recovery."""
    marks = [(at - since, f"device plugin: {name}") for name, at in plugin.items()]
    found = recoveries(read_events(run_dir))
    if found:
        marks += [(at - since, label) for at, label in found[0].marks]
    return sorted(marks), found[0] if found else None


def load_weights(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every array train_mlp.py wrote under ``directory``: file → name → array."""
    found: dict[str, dict[str, np.ndarray]] = {}
    for path in sorted(directory.rglob("*")):
        relative = str(path.relative_to(directory))
        if path.suffix == ".npz":
            with np.load(path) as data:
                found[relative] = {name: data[name] for name in data.files}
        elif path.suffix == ".npy":
            found[relative] = {"array": np.load(path)}
        elif path.suffix == ".ckpt":
            import mindspore as ms  # only for MindSpore's checkpoint format

            found[relative] = {name: param.asnumpy() for name, param in ms.load_checkpoint(str(path)).items()}
    return found


def compare(reference: Path, faulted: Path) -> bool:
    """Print a per-file comparison; True if every array is bit-identical."""
    ref, got = load_weights(reference), load_weights(faulted)
    if not ref:
        say(f"no weights found in {reference} (expected .npz, .npy or .ckpt files)")
        return False
    identical = True
    print(f"  {'file':<28} {'arrays':>6} {'values':>9} {'max |diff|':>11}  bit-identical")
    for name, arrays in ref.items():
        other = got.get(name, {})
        same = set(arrays) == set(other)
        values, diff = 0, 0.0
        for key, array in arrays.items():
            values += array.size
            if key not in other or other[key].shape != array.shape or other[key].dtype != array.dtype:
                same = False
                continue
            if array.tobytes() != other[key].tobytes():
                same = False
                diff = max(diff, float(np.max(np.abs(array.astype(np.float64) - other[key].astype(np.float64)))))
        identical &= same
        print(f"  {name:<28} {len(arrays):>6} {values:>9} {diff:>11.3g}  {'yes' if same else 'NO'}")
    missing = sorted(set(got) ^ set(ref))
    if missing:
        say(f"files present in only one run: {missing}")
        identical = False
    return identical


def main(argv: Optional[list[str]] = None) -> int:
    """Run the demo; Ctrl-C (or SIGTERM) stops every launcher it started, and their ranks."""
    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        return _demo(argv)
    except KeyboardInterrupt:
        say("interrupted: stopping mindft-launch and every rank")
        for run in Run.started_runs:
            run.stop(signal.SIGINT)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _demo(argv: Optional[list[str]]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs of 256 samples (default 6: 48 steps on 4 "
                                                                  "ranks)")
    parser.add_argument("--step-seconds", type=float, default=0.15,
                        help="each step sleeps this long, so the fault lands mid-run (default 0.15)")
    parser.add_argument("--fault", choices=("hot-reset", "kill"), default="hot-reset",
                        help="hot-reset: the device plugin resets the chip (default); kill: SIGKILL the "
                             "rank's process, mindft-launch restarts it from the node agent's memory")
    parser.add_argument("--fault-rank", type=int, default=2, help="rank that is hit (default 2)")
    parser.add_argument("--fault-step", type=int, default=20,
                        help="inject the fault once this step is committed (default 20)")
    parser.add_argument("--reset-seconds", type=float, default=1.5,
                        help="how long the chip stays 'unrecovered' (default 1.5)")
    parser.add_argument("--workdir", type=Path, help="keep outputs here (default: a temporary directory)")
    parser.add_argument("--verbose", action="store_true", help="show every line of both runs")
    parser.add_argument("train_args", nargs="*", help="extra arguments for train_dp.py (after --)")
    args = parser.parse_args(argv)
    if not TRAIN.exists():
        say(f"{TRAIN} is missing")
        return 2
    steps = args.epochs * (256 // args.nproc // 8)
    if not 0 <= args.fault_rank < args.nproc or not 0 < args.fault_step < steps:
        parser.error(f"need 0 <= --fault-rank < --nproc and 0 < --fault-step < {steps} (the steps of --epochs)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mindft-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ, MS_ENABLE_TFT=os.environ.get("MS_ENABLE_TFT", "{RSC:1}"),
                    MINDFT_HEARTBEAT_INTERVAL="0.2", MINDFT_RESET_POLL_INTERVAL="0.1")
    base_env.pop("MINDFT_KEY_FILE", None)

    say(f"stage 1 of 3, the reference: {args.nproc} ranks, data-parallel, {steps} steps, no fault")
    ref_env = dict(base_env, MINDFT_RESET_FILE=str(work / "ref-reset" / "reset.json"),
                   MINDFT_DUMP_DIR=str(work / "ref-dump"))
    reference = Run("reference", launcher_command(args.nproc, work / "ref-run", work / "ref", args.epochs,
                                                  args.step_seconds, args.train_args), ref_env, args.verbose)
    code = reference.wait()
    say(f"reference run finished: exit {code} in {reference.seconds:.1f}s")
    if code != 0:
        print("".join(reference.lines[-40:]), end="")
        return 1

    reset_file = work / "reset" / "reset.json"
    reset_file.parent.mkdir(parents=True, exist_ok=True)  # on Ascend, the device plugin's mount
    if args.fault == "hot-reset":
        say(f"stage 2 of 3, the same training; at step {args.fault_step} the device plugin hot-resets rank "
            f"{args.fault_rank}'s chip (writing {reset_file})")
    else:
        say(f"stage 2 of 3, the same training; at step {args.fault_step} rank {args.fault_rank}'s process is killed")
    fault_env = dict(base_env, MINDFT_RESET_FILE=str(reset_file), MINDFT_DUMP_DIR=str(work / "fault-dump"))
    faulted = Run("faulted", launcher_command(args.nproc, work / "fault-run", work / "fault", args.epochs,
                                              args.step_seconds, args.train_args), fault_env, args.verbose)
    plugin: dict[str, float] = {}
    try:
        client = controller_of(work / "fault-run", 60.0)
        status = wait_for(client, faulted, lambda s: s.step >= args.fault_step, f"step {args.fault_step}")
        fault_at = time.time()  # wall clock, as the event log's times
        if args.fault == "kill":
            pid = next(r.pid for r in status.ranks if r.rank == args.fault_rank)
            os.kill(pid, signal.SIGKILL)
            say(f"sent SIGKILL to rank {args.fault_rank} (pid {pid})")
        else:
            hot_reset(work / "fault-run" / "job.json", args.fault_rank, args.reset_seconds, plugin)
    except Exception:
        faulted.stop()
        raise
    code = faulted.wait()
    say(f"faulted run finished: exit {code} in {faulted.seconds:.1f}s")
    marks, recovery = timeline(work / "fault-run", fault_at, plugin)
    lines = render(recovery) if recovery is not None else []
    for line in lines[:1]:  # what it was, the ladder's rung, how long it took
        say(line)
    say(f"timeline (seconds after the fault), from the event log in {work / 'fault-run'} "
        f"('mindft events --job {work / 'fault-run'}' prints it too):")
    for seconds, what in marks:
        print(f"  {seconds:7.2f}  {what}", flush=True)
    for line in lines[-1:]:
        if line.strip().startswith("phases:"):
            print(line, flush=True)
    recovered = recovery is not None and recovery.outcome == "recovered"
    if code != 0 or not recovered:
        what = (f"its launcher exited {code}" if code != 0 else "") + (", and " if code != 0 and not recovered
                                                                      else "")
        what += "" if recovered else ("no recovery ended in its event log" if recovery is None
                                      else f"its recovery {recovery.outcome}")
        say(f"the faulted run did not end as it should: {what}; its last lines:")
        print("".join(faulted.lines[-40:]), end="")
        if not load_weights(work / "fault"):
            return 1
        say("it wrote its final weights all the same; comparing them:")

    say(f"stage 3 of 3, the final weights of all {args.nproc} ranks, reference vs faulted run:")
    identical = compare(work / "ref", work / "fault")
    if code != 0 or not recovered:
        say(f"weights {'bit-identical' if identical else 'DIFFER'}; the run's verdict stands (exit 1)")
        return 1
    if identical:
        what = "hot reset of" if args.fault == "hot-reset" else "killed process of"
        say(f"bit-identical: the {what} rank {args.fault_rank} cost a pause, not a single bit "
            f"(outputs in {work})")
        return 0
    say(f"weights DIFFER (outputs in {work})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
