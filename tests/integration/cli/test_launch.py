"""mindft-launch with real processes: restarts, the reset file, signals, exit codes.

The ranks run tests/fake_rank.py (the rank engine and recovery flow
with a numpy "model"), so a test checks the final weights bit for bit against the
fault-free result.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from mindft.device.simulator import fault_state
from mindft.device.resetfile import write_reset_file

import fake_rank  # the rank script doubles as the reference implementation
from harness import FAKE_RANK, ROOT, free_port_pair
from launching import DEADLINE, RANK_SCRIPT, Job

PLAIN_SCRIPT = FAKE_RANK
pytestmark = pytest.mark.mindspore  # mindft-launch starts MindSpore's scheduler


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_rank_is_restarted_and_training_is_bit_identical(launch: Callable[..., Job]) -> None:
    job = launch(nproc=2, steps=30, LAUNCH_CRASH="1:10")
    assert job.wait() == 0, job.text()
    out = job.text()
    assert "rank 1 (pid" in out and "killed by SIGKILL" in out
    assert "restarting rank 1 (restart 1/3)" in out
    assert "[rank 1] rank 1 incarnation 1" in out          # prefixed console output of the new process
    assert "ROLLBACK" in out and "DONE" in out
    job.assert_bit_identical()
    log_1 = (job.run_dir / "logs" / "rank_1.log").read_text()
    assert log_1.count("--- mindft-launch: rank 1, incarnation") == 2
    assert "rank 1 incarnation 1" in log_1 and "[rank" not in log_1  # log files hold the raw output
    assert not (job.run_dir / "keys.json").exists()          # the generated secret does not outlive the job


def test_a_rank_that_crashes_after_the_job_finished_leaves_the_exit_code_0(launch: Callable[..., Job]) -> None:
    """Rank 1 finishes (its final state written, the job DONE), then dies of SIGSEGV, as MindSpore's
    own teardown sometimes does: the job finished, and the launcher says so."""
    job = launch(nproc=2, steps=10, LAUNCH_SEGFAULT_AT_EXIT="1")
    assert job.wait() == 0, job.text()
    out = job.text()
    assert "rank 1 died after the job finished (in MindSpore's teardown): not a failure of the job" in out
    job.assert_bit_identical()


def test_corrupted_reset_file_then_hot_reset(launch: Callable[..., Job], tmp_path: Path) -> None:
    reset = tmp_path / "reset" / "reset.json"
    reset.parent.mkdir()
    reset.write_text("\x00garbage{")                           # there before the job starts
    job = launch(nproc=2, steps=60, step_time=0.03)
    job.wait_until(lambda: job.committed() >= 5, "step 5")
    half = reset.with_name("half")
    half.write_text('{"RankList": [{"RankId": 1, "Status": "unrec')  # the plugin caught mid-write
    os.replace(half, reset)
    time.sleep(0.3)
    write_reset_file(reset, fault_state([1], policy="reset"))
    job.wait_until(lambda: "REPAIRING" in job.text(), "the controller to wait for the device")
    write_reset_file(reset, fault_state([1], "recovered", policy="reset"))
    assert job.wait() == 0, job.text()
    out = job.text()
    assert out.count("not valid JSON") == 1                  # each bad content logged once, not every poll
    assert "DEVICE_RESET" in out and "RESUMING → NORMAL" in out
    job.assert_bit_identical()


def test_sigterm_stops_every_rank(launch: Callable[..., Job]) -> None:
    # The ranks ignore SIGTERM, so the launcher must escalate to SIGKILL after the grace period.
    job = launch(nproc=2, steps=100000, step_time=0.05, args=("--grace-period", "1"), LAUNCH_IGNORE_TERM="1")
    job.wait_until(lambda: len(job.rank_pids()) == 2 and job.committed() >= 1, "training to start")
    pids = job.rank_pids()
    job.process.send_signal(signal.SIGTERM)
    assert job.wait(30) == 128 + signal.SIGTERM
    assert "SIGTERM: stopping every rank" in job.text()
    assert "did not stop within 1s; sending SIGKILL" in job.text()
    assert "controller finished: exit code 1" not in job.text()  # the launcher's verdict is the last word
    assert job.text().rstrip().endswith("exit code 143: interrupted by SIGTERM")
    survivors = [pid for pid in pids if _alive(pid)]
    assert survivors == [], f"ranks still alive after the launcher exited: {survivors}"


def test_rank_out_of_restarts_fails_the_job_quickly(launch: Callable[..., Job], tmp_path: Path) -> None:
    job = launch(nproc=2, steps=1000, step_time=0.02, args=("--max-restarts", "1"), LAUNCH_CRASH_ALWAYS="1")
    code = job.wait(60)
    out = job.text()
    assert code == 1, out
    assert "not restarting rank 1: it used all 1 restarts" in out
    assert "rank 0 dumped step" in out                     # the healthy rank wrote its dying gasp
    assert any((tmp_path / "dump").glob("rank0-step*.npy"))
    assert "exit 3 (dying-gasp checkpoint written)" in out


def test_rank_that_gives_up_fails_the_job_without_waiting_for_the_repair_timeout(
        launch: Callable[..., Job], tmp_path: Path) -> None:
    # MINDFT_REPAIR_TIMEOUT is 300 s here: only the launcher's report can end the job in time.
    job = launch(nproc=2, steps=1000, step_time=0.02, LAUNCH_GIVE_UP="1:5", MINDFT_REPAIR_TIMEOUT="300")
    code = job.wait(60)
    out = job.text()
    assert code == 3, out                                # every rank wrote its dying-gasp checkpoint
    assert "exit 3 (dying-gasp checkpoint written)" in out
    assert "exited with code 3 and will not be restarted" in out  # handed to the controller in-process
    assert "restarting rank 1" not in out                # exit 3 is final
    assert "rank 0 dumped step" in out


def test_rank_whose_dump_failed_is_not_reported_as_dumped(launch: Callable[..., Job]) -> None:
    job = launch(nproc=2, steps=1000, step_time=0.02, script=RANK_SCRIPT,
                 LAUNCH_GIVE_UP="1:5:4", MINDFT_REPAIR_TIMEOUT="300")
    code = job.wait(60)
    out = job.text()
    assert code == 4, out
    assert "exit 4 (stopped; dying-gasp checkpoint NOT written)" in out
    assert "exited with code 4 and will not be restarted" in out
    assert "rank 1 (pid" in out and not any("rank 1 (pid" in line and "checkpoint written" in line
                                            for line in out.splitlines())
    assert "rank 0 dumped step" in out and "exit 3 (dying-gasp checkpoint written)" in out


def test_device_failed_every_rank_dumps_and_the_launcher_exits_3(launch: Callable[..., Job],
                                                                 tmp_path: Path) -> None:
    job = launch(nproc=2, steps=1000, step_time=0.02)
    job.wait_until(lambda: job.committed() >= 5, "step 5")
    write_reset_file(job.reset_file, fault_state([1], policy="reset"))
    job.wait_until(lambda: "REPAIRING" in job.text(), "the controller to wait for the device")
    write_reset_file(job.reset_file, fault_state([1], "failed", policy="reset"))
    code = job.wait(60)
    out = job.text()
    assert code == 3, out
    assert "rank 0 dumped step" in out and "rank 1 leaves its device" in out
    assert "rank 1 had no process; the agent wrote its dying-gasp checkpoint from memory" in out
    assert out.count("exit 3 (dying-gasp checkpoint written)") == 1
    # Rank 0 dumps itself; rank 1 had left its device, so the agent dumps it from its memory.
    assert len(list((tmp_path / "dump").glob("rank0-step*.npy"))) == 1
    assert len(list((tmp_path / "dump").glob("mindft-rank1-step*.ckpt"))) == 1


def test_hung_rank_is_killed_and_restarted(launch: Callable[..., Job]) -> None:
    job = launch(nproc=2, steps=80, step_time=0.03)
    job.wait_until(lambda: job.committed() >= 5, "step 5")
    info = job.job_info()
    result = subprocess.run([sys.executable, "-c", "from mindft.cli.main import main; main()", "inject", "--rank",
                             "0", "--fault", "hang", "--job", str(job.run_dir / "job.json")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert f"sent SIGSTOP to rank 0 (pid {info['ranks']['0']})" in result.stdout
    assert job.wait() == 0, job.text()
    out = job.text()
    assert "HANG" in out and "killing it so it can restart" in out
    assert "restarting rank 0 (restart 1/3)" in out
    job.assert_bit_identical()


def test_injected_uce_is_recovered(launch: Callable[..., Job]) -> None:
    job = launch(nproc=2, steps=60, step_time=0.03)
    job.wait_until(lambda: job.committed() >= 5, "step 5")
    result = subprocess.run([sys.executable, "-c", "from mindft.cli.main import main; main()", "inject", "--rank",
                             "1", "--fault", "uce", "--job", str(job.run_dir / "job.json"), "--json"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ok"] is True
    assert job.wait() == 0, job.text()
    assert "rank=1 fault UCE" in job.text() and "recovery 1 done" in job.text()
    job.assert_bit_identical()


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mindft.cli.launch", "--nnodes", "2", "--node-rank", "0",
                             str(RANK_SCRIPT)], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "MINDFT_KEY_FILE": "", "MS_ENABLE_TFT": "{RSC:1}"})
    assert result.returncode == 2
    assert "needs one key on every node" in result.stderr
    bad_tft = subprocess.run([sys.executable, "-m", "mindft.cli.launch", str(RANK_SCRIPT)], capture_output=True,
                             text=True, timeout=30, env={**os.environ, "MS_ENABLE_TFT": "{RSC:1,UCE:1}"})
    assert bad_tft.returncode == 2 and "RSC" in bad_tft.stderr and "UCE" in bad_tft.stderr


def test_demo_hot_reset_with_mindspore_is_bit_identical(tmp_path: Path) -> None:
    """The README's first command, smaller: data-parallel MindSpore training, a hot reset played as
    the device plugin does, the ladder's decision and timeline, identical weights."""
    demo = ROOT / "examples" / "demo.py"
    result = subprocess.run([sys.executable, str(demo), "--nproc", "2", "--epochs", "2", "--fault-step", "8",
                             "--fault-rank", "1", "--reset-seconds", "0.5", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for phase in ("NORMAL → PAUSING", "PAUSING → REPAIRING", "REPAIRING → ROLLBACK", "ROLLBACK → RESUMING",
                  "RESUMING → NORMAL"):
        assert phase in out
    assert "DEVICE_RESET" in out and "restarting every worker from the node agents' memory" in out
    # The plugin reset the chip only after the rank's process had left it, then wrote 'recovered'.
    plugin = [line for line in out.splitlines() if "device plugin: rank 1" in line]
    assert [p.split("rank 1 ", 1)[1].split(" (")[0].split(" —")[0] for p in plugin] == [
        "unrecovered", "process left the chip", "recovered"], plugin
    timeline = out[out.index("timeline (seconds after the fault)"):]
    assert "ladder: every worker restarts" in timeline and "training resumed" in timeline
    assert out.count(" yes") == 2 and "bit-identical:" in out


@pytest.mark.parametrize("scope", ["rank", "all"])
def test_two_nodes_share_one_controller_and_key(tmp_path: Path, scope: str) -> None:
    """Two launchers on loopback as nodes 0 and 1; a crash on node 1 is reported over the wire.

    With MINDFT_RESTART_SCOPE=all every worker on both nodes restarts: node 1 learns the
    controller's kills and starts from its status."""
    port = free_port_pair()  # the controller's, below the ephemeral range
    keys = tmp_path / "keys.json"
    assert subprocess.run([sys.executable, "-c", "from mindft.cli.main import main; main()", "keygen", str(keys)],
                          capture_output=True, timeout=30).returncode == 0
    env = {**os.environ, "LAUNCH_DIR": str(tmp_path), "LAUNCH_STEPS": "30", "LAUNCH_CRASH": "3:10",
           "MINDFT_HEARTBEAT_INTERVAL": "0.1", "MINDFT_RESET_FILE": str(tmp_path / "reset.json"),
           "MINDFT_REPAIR_TIMEOUT": "30", "MS_ENABLE_TFT": "{RSC:1}", "MINDFT_RESTART_SCOPE": scope}
    env.pop("MINDFT_KEY_FILE", None)
    nodes = []
    try:
        for node in (1, 0):
            out = open(tmp_path / f"node{node}.out", "wb")
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--nnodes", "2", "--node-rank", str(node),
                 "--master-port", str(port), "--key-file", str(keys), "--run-dir", str(tmp_path / f"run{node}"),
                 str(RANK_SCRIPT)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            out.close()
        codes = [process.wait(DEADLINE) for process in nodes]
    finally:
        for process in nodes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    node0, node1 = (tmp_path / "node0.out").read_text(), (tmp_path / "node1.out").read_text()
    assert codes == [0, 0], node0 + node1
    assert "[rank 3] rank 3 incarnation 1" in node1
    if scope == "rank":
        assert "restarting rank 3" in node1 and "[rank 2] rank 2 incarnation 1" not in node1
    else:
        assert "restarting every worker" in node0
        for node, out in ((0, node0), (1, node1)):
            for rank in (2 * node, 2 * node + 1):
                assert f"[rank {rank}] rank {rank} incarnation 1" in out, out
    assert "rank=3 fault PROCESS_DIED" in node0 and "exited with code -9" in node0  # ProcessExit from node 1
    assert "[controller]" not in node1                                            # node 1 runs no controller
    for rank in range(4):
        final = np.load(tmp_path / f"final-{rank}.npy")
        assert final.tobytes() == fake_rank.reference(rank, 30).tobytes()


def run_plain(tmp_path: Path, *args: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess:
    """mindft-launch on fake_rank.py in plain mode (no mindft inside the ranks), to completion."""
    full_env = {**os.environ, "MINDFT_RESET_FILE": str(tmp_path / "reset.json"), **env}
    for name in ("MINDFT_KEY_FILE", "MINDFT_INSECURE"):
        full_env.pop(name, None)
    if "MS_ENABLE_TFT" not in env:
        full_env.pop("MS_ENABLE_TFT", None)
    return subprocess.run([sys.executable, "-m", "mindft.cli.launch", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def test_without_ms_enable_tft_the_job_runs_unprotected_and_exits_0(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_plain(tmp_path, "--nproc", "2", "--run-dir", str(tmp_path / "run"), str(PLAIN_SCRIPT))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert out.count("fault tolerance is OFF (MS_ENABLE_TFT is not set)") == 1
    assert "MS_ENABLE_TFT='{RSC:1}'" in out
    assert "plain rank 0 done" in out and "plain rank 1 done" in out
    assert "[controller]" not in out and "no controller" in out
    assert not (tmp_path / "run" / "keys.json").exists()
    assert time.monotonic() - started < 14  # not the 15 s wait for a controller verdict


def test_unprotected_rank_failure_stops_the_job_with_its_code(tmp_path: Path) -> None:
    result = run_plain(tmp_path, "--nproc", "2", str(PLAIN_SCRIPT), PLAIN_EXIT="1:7", PLAIN_SLEEP="0.5",
                       MS_ENABLE_TFT="{TTP:0}")
    out = result.stdout + result.stderr
    assert result.returncode == 7, out
    assert "MS_ENABLE_TFT='{TTP:0}' enables no option" in out
    assert "restarting" not in out


def test_missing_training_script_fails_at_once(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_train.py"
    for tft in ("{RSC:1}", ""):
        result = run_plain(tmp_path, "--nproc", "2", str(missing), timeout=30, MS_ENABLE_TFT=tft)
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"training script {str(missing)!r} does not exist" in result.stderr
        assert "restarting rank" not in result.stdout
    command = run_plain(tmp_path, "no-such-command-mindft", timeout=30, MS_ENABLE_TFT="{RSC:1}")
    assert command.returncode == 2 and "'no-such-command-mindft' is not an executable" in command.stderr


def test_rank_that_dies_before_the_job_starts_is_not_restarted(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_plain(tmp_path, "--nproc", "2", "--run-dir", str(tmp_path / "run"), str(PLAIN_SCRIPT),
                       MS_ENABLE_TFT="{RSC:1}", PLAIN_EXIT="1:1", PLAIN_SLEEP="0.3")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "job failed: rank 1 exit 1 (failed) before the job started; not restarting it" in out
    assert str(tmp_path / "run" / "logs" / "rank_1.log") in out
    assert "restarting rank" not in out and "recovers from its peer replica" not in out
    assert time.monotonic() - started < 12, out  # neither restarts nor the 15 s wait for a verdict


def test_ranks_that_never_register_fail_the_job_at_once(tmp_path: Path) -> None:
    result = run_plain(tmp_path, "--nproc", "2", str(PLAIN_SCRIPT), MS_ENABLE_TFT="{RSC:1}")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "every rank exited before registering with the controller" in out
    assert "controller has no result" not in out


def test_run_directory_is_named_and_holds_only_logs_afterwards(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    refused = run_plain(tmp_path, "--key-file", str(tmp_path / "missing.json"), str(PLAIN_SCRIPT),
                        MS_ENABLE_TFT="{RSC:1}", TMPDIR=str(temp))
    assert refused.returncode == 2 and "does not exist" in refused.stderr
    bad_tft = run_plain(tmp_path, str(PLAIN_SCRIPT), MS_ENABLE_TFT="{RSC:1,UCE:1}", TMPDIR=str(temp))
    assert bad_tft.returncode == 2
    assert list(temp.iterdir()) == []                       # a refused launch leaves no mindft-run-*
    never = run_plain(tmp_path, "--nproc", "1", str(PLAIN_SCRIPT), MS_ENABLE_TFT="{RSC:1}", TMPDIR=str(temp))
    assert never.returncode == 1
    (run_dir,) = temp.iterdir()                             # it ran: its log is kept
    out = never.stdout + never.stderr
    assert f"run directory {run_dir}" in out and f"logs kept in {run_dir / 'logs'}" in out
    # No key, no stale job.json; the logs and the event log (mindft events) stay.
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("events")) == ["logs"]
    assert (run_dir / "events-node0.jsonl").is_file()
    assert "plain rank 0" in (run_dir / "logs" / "rank_0.log").read_text()


def test_dead_reset_watcher_is_restarted_and_the_next_fault_is_handled(launch: Callable[..., Job]) -> None:
    job = launch(nproc=2, steps=300, step_time=0.03)
    job.wait_until(lambda: job.committed() >= 5 and "watching the device plugin's reset file" in job.text(),
                   "step 5 and the watcher")
    job.reset_file.parent.mkdir(parents=True, exist_ok=True)
    hostile = job.reset_file.with_name("hostile")
    for content in (b"[" * 100_000 + b"]" * 100_000,        # kills a JSON reader that recurses
                    b'{"RankList":[{"RankId":' + b"7" * 5000 + b',"Status":"unrecovered"}]}',  # int limit
                    b"\xff\xfe" + b"\x00" * 3000,            # not UTF-8
                    b'{"RankList":[' + b'{"RankId":1},' * 200_000 + b'{}]}'):   # over the size bound
        hostile.write_bytes(content)
        os.replace(hostile, job.reset_file)
        time.sleep(0.5)                                     # a watcher that survives just logs it
    write_reset_file(job.reset_file, fault_state([1], policy="reset"))
    job.wait_until(lambda: "REPAIRING" in job.text(), "the controller to wait for the device")
    write_reset_file(job.reset_file, fault_state([1], "recovered", policy="reset"))
    assert job.wait() == 0, job.text()
    out = job.text()
    assert "DEVICE_RESET" in out and "RESUMING → NORMAL" in out
    assert "watcher thread died" not in out  # the reader bounds its input now: nothing to restart
    job.assert_bit_identical()


def test_progress_is_shown_while_waiting_for_a_repair(launch: Callable[..., Job]) -> None:
    job = launch(nproc=2, steps=200, step_time=0.03, args=("--progress-interval", "0.5"))
    job.wait_until(lambda: job.committed() >= 5, "step 5")
    write_reset_file(job.reset_file, fault_state([1], policy="reset"))
    job.wait_until(lambda: job.text().count("REPAIRING for") >= 3, "three progress lines", timeout=20)
    before_recovered = job.text()  # afterwards the rank's new process is waited for, not the device
    write_reset_file(job.reset_file, fault_state([1], "recovered", policy="reset"))
    assert job.wait() == 0, job.text()
    lines = [line for line in before_recovered.splitlines() if "recovery 1: REPAIRING for" in line]
    assert len(lines) >= 3
    assert all("waiting for rank 1 (its chip is being reset); " in line for line in lines)
    lefts = [int(line.split("; ")[1].split("s left")[0]) for line in lines]
    assert lefts == sorted(lefts, reverse=True) and lefts[0] <= 30   # MINDFT_REPAIR_TIMEOUT=30
    assert job.text().rstrip().endswith("exit code 0: finished")


def test_ctrl_c_on_the_demo_stops_its_launcher_and_every_rank(tmp_path: Path) -> None:
    demo = ROOT / "examples" / "demo.py"
    out_path = tmp_path / "demo.out"
    with open(out_path, "wb") as out:
        process = subprocess.Popen([sys.executable, str(demo), "--nproc", "2", "--epochs", "1000",
                                    "--fault-rank", "1", "--workdir", str(tmp_path)], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   # A suite run as a background job of a shell inherits SIGINT ignored.
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    job_file = tmp_path / "ref-run" / "job.json"
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                info = json.loads(job_file.read_text())
                if len(info["ranks"]) == 2 and "STARTING → NORMAL" in out_path.read_text():
                    pids = [info["launcher_pid"], *(int(pid) for pid in info["ranks"].values())]
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        assert pids, out_path.read_text()[-3000:]
        process.send_signal(signal.SIGINT)                  # what the terminal sends on Ctrl-C
        assert process.wait(60) == 130, out_path.read_text()[-3000:]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert [pid for pid in pids if _alive(pid)] == [], out_path.read_text()[-3000:]
        assert "interrupted: stopping mindft-launch and every rank" in out_path.read_text()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)              # lets the demo stop what it started
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for pid in [process.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.wait()


def test_a_killed_launcher_leaves_no_key_on_disk_and_the_next_one_frees_its_memory(tmp_path: Path) -> None:
    """The generated job key is in memory, not in the run directory; a launcher killed with SIGKILL
    cannot clean up, and the next launcher on the host removes its key and its shared memory."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "MS_ENABLE_TFT": "{RSC:1}", "MINDFT_RESET_FILE": str(tmp_path / "reset.json"),
           "PLAIN_SLEEP": "120", "MINDFT_WARM_START": "0"}
    for name in ("MINDFT_KEY_FILE", "MINDFT_INSECURE"):
        env.pop(name, None)
    killed = subprocess.Popen([sys.executable, "-m", "mindft.cli.launch", "--nproc", "1", "--no-scheduler",
                               "--run-dir", str(run_dir), str(PLAIN_SCRIPT)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "job.json").exists():
            assert time.monotonic() < deadline and killed.poll() is None, "the launcher wrote no job.json"
            time.sleep(0.1)
        key_file = Path(json.loads((run_dir / "job.json").read_text())["key_file"])
        assert key_file.is_file() and run_dir not in key_file.parents and not list(run_dir.glob("*key*"))
        memory = next(d for d in key_file.parent.parent.glob("mindft-state-*")  # found while its owner runs
                      if '"pid": %d' % killed.pid in (d / "owner.json").read_text())
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(10)
        # Nobody but the next launcher on the host removes them: this test's, or another test's started meanwhile.
        left = key_file.exists() and memory.is_dir()
        result = run_plain(tmp_path, "--nproc", "1", "--no-scheduler", str(PLAIN_SCRIPT), MS_ENABLE_TFT="{RSC:1}")
        out = result.stdout + result.stderr
        assert not left or "memory directories of launchers on this host that are gone" in out, out
        assert not key_file.parent.exists() and not memory.exists()
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
