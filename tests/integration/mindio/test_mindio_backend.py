"""MINDFT_BACKEND=mindio end to end: the examples under mindft-launch, on MindIO TFT's real wheel.

mindft-launch runs MindIO's controller and the step gate; every rank is real MindSpore training on
CPU with MindIO's processor (tests/integration/mindspore/test_mindspore_recovery.py runs the same examples on
mindft's own controller). Reference weights come from the examples run with mindft off. Without the
wheel these tests skip locally and FAIL when CI is set.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindft.exitcodes import ExitCode

from harness import EXAMPLE_ARGS, ExampleReferences, assert_ranks_identical, fault_free_weights  # noqa: E402
from test_mindio_recovery import require_mindio  # noqa: E402

pytestmark = [pytest.mark.mindspore, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
REFERENCES = (("train_mlp", 2), ("train_mlp", 4), ("train_model", 2))
JOB_TIMEOUT = 180.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "MINDFT_", "RANK_", "MINDX_", "TTP_"))}
    env.update(GLOG_v="3", PYTHONUNBUFFERED="1", TTP_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), **extra)
    return env


@pytest.fixture(scope="module")
def reference(example_references: ExampleReferences) -> Path:
    """Fault-free weights of every (example, world size, rank) used below, mindft off, one process
    (shared with tests/integration/mindspore/test_mindspore_recovery.py's when on the same worker)."""
    require_mindio()
    return example_references.need(*REFERENCES)


def launch(tmp: Path, example: str, world_size: int, *args: str, tft: str = "{UCE:1}") -> tuple[int, str, float]:
    """``MINDFT_BACKEND=mindio mindft-launch --nproc N examples/EXAMPLE.py``: (exit code, output, seconds)."""
    env = _env(MINDFT_BACKEND="mindio", MS_ENABLE_TFT=tft, MINDFT_DUMP_DIR=str(tmp / "dump"))
    command = [sys.executable, "-m", "mindft.cli.launch", "--nproc", str(world_size), "--run-dir", str(tmp / "run"),
               str(EXAMPLES / f"{example}.py"), *EXAMPLE_ARGS[example], "--out", str(tmp / "out"), *args]
    started = time.monotonic()
    with open(tmp / "launch.log", "wb") as log:
        # Its own session: on a hang the launcher and its ranks are killed as one process group.
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
        try:
            code = process.wait(JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
            pytest.fail(f"mindft-launch still running after {JOB_TIMEOUT} s:\n{(tmp / 'launch.log').read_text()[-4000:]}")
    return code, (tmp / "launch.log").read_text(errors="replace"), time.monotonic() - started


def assert_identical(tmp: Path, reference: Path, example: str, world_size: int) -> None:
    assert_ranks_identical(tmp / "out", reference / example / str(world_size), world_size)


@pytest.mark.parametrize("example, world_size, fault_rank, fault_step, tft", [
    ("train_mlp", 2, 1, 6, "{UCE:1}"),
    ("train_mlp", 4, 2, 6, "{RSC:1}"),
    pytest.param("train_model", 2, 0, 11, "{UCE:1}", marks=pytest.mark.compat),
])
def test_uce_on_one_rank_is_recovered_through_mindio_bit_identically(tmp_path: Path, reference: Path, example: str,
                                                                    world_size: int, fault_rank: int,
                                                                    fault_step: int, tft: str) -> None:
    code, output, _ = launch(tmp_path, example, world_size, "--fault-step", str(fault_step),
                             "--fault-rank", str(fault_rank), tft=tft)
    assert code == ExitCode.OK, output[-4000:]
    assert "fault-tolerance backend: mindio (MINDFT_BACKEND=mindio)" in output
    assert f"[rank {fault_rank}] rank={fault_rank} reporting UCE to MindIO" in output
    # The controller goes first, so no processor is destroyed while it lives (a wheel race aborts one).
    assert output.index("destroying MindIO's controller before") < output.index("exit 0 (finished)")
    # MindIO chose one repair step r for every rank; the faulty rank, which never finished r,
    # restored its own step r - 1 and replayed r.
    repair_steps = {int(m) for m in re.findall(r"MindIO's repair step (\d+)\)", output)}
    assert len(repair_steps) == 1, output[-4000:]
    repair = repair_steps.pop()
    assert fault_step - 1 <= repair <= fault_step
    resumed = dict(re.findall(r"\[rank (\d+)\] rank=\d+ resumed after step (\d+)", output))
    assert sorted(resumed) == [str(rank) for rank in range(world_size)], output[-4000:]
    assert int(resumed[str(fault_rank)]) == fault_step - 1
    assert_identical(tmp_path, reference, example, world_size)


def test_killed_rank_ends_the_job_with_dying_gasp_checkpoints(tmp_path: Path) -> None:
    """MindIO cannot restart a killed rank: the launcher does not restart it, MindIO notices the
    lost heartbeats (~10 s), the live rank writes its dying-gasp checkpoint and exits 3, the launcher
    exits with the killed rank's code (128 + 9)."""
    require_mindio()
    code, output, seconds = launch(tmp_path, "train_mlp", 2, "--fault-step", "5", "--fault-rank", "1",
                                   "--fault-kind", "exit")
    assert code == 137, output[-4000:]
    assert "restarts are off" in output and "not restarting rank 1" in output
    assert "rank 0 (pid" in output and "exit 3 (dying-gasp checkpoint written)" in output
    assert "MindIO cannot restart a lost rank without MindCluster's ARF" in output
    dumps = sorted((tmp_path / "dump").glob("mindft-rank0-step*.ckpt"))
    assert len(dumps) == 1, output[-4000:]
    manifest = json.loads(dumps[0].with_suffix(".json").read_text())
    # Rank 1 died inside step 5 after finishing 4: the gate let rank 0 run 5 at most.
    assert manifest["rank"] == 0 and manifest["step"] in (4, 5)
    assert seconds < 90, f"the job took {seconds:.0f} s to end"  # a bound against hangs, not a benchmark



HOT_RESET_STEPS = 400  # long enough (~10 s on 2 ranks here) for the plugin to strike mid-training


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fault-free weights of train_mlp, 2 ranks, HOT_RESET_STEPS steps, mindft off."""
    require_mindio()
    return fault_free_weights(tmp_path_factory.mktemp("reference-long"),
                              [("train_mlp", 2, ["--steps", str(HOT_RESET_STEPS)])])


def hot_reset(tmp: Path, outcome: str) -> tuple[int, str, str]:
    """train_mlp on 2 ranks under mindft-launch on MindIO; once rank 1 passed step 20, ``mindft
    simulate-device-plugin --job`` resets rank 1's chip (it waits, as the plugin does, for the
    chip's process to exit) and writes ``outcome``. (launcher exit code, its output, the plugin's)."""
    reset_file = tmp / "reset" / "reset.json"
    reset_file.parent.mkdir()  # the device plugin's mount
    env = _env(MINDFT_BACKEND="mindio", MS_ENABLE_TFT="{RSC:1}", MINDFT_DUMP_DIR=str(tmp / "dump"),
               MINDFT_RESET_FILE=str(reset_file), MINDFT_RESET_POLL_INTERVAL="0.1")
    command = [sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--run-dir", str(tmp / "run"),
               str(EXAMPLES / "train_mlp.py"), "--steps", str(HOT_RESET_STEPS), "--out", str(tmp / "out")]
    log_path = tmp / "launch.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
        try:
            deadline = time.monotonic() + JOB_TIMEOUT
            while "[rank 1] rank 1 step 20 loss" not in log_path.read_text(errors="replace"):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"training did not reach step 20:\n{log_path.read_text()[-4000:]}")
                time.sleep(0.05)
            plugin = subprocess.run([sys.executable, "-c", "from mindft.cli.main import main; main()",
                                     "simulate-device-plugin", "--job", str(tmp / "run" / "job.json"), "--rank", "1",
                                     "--hold", "0.5", "--policy", "reset", "--outcome", outcome],
                                    env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT)
            code = process.wait(JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
            pytest.fail(f"the hot reset job hung:\n{log_path.read_text()[-4000:]}")
    return code, log_path.read_text(errors="replace"), plugin.stdout + plugin.stderr


def test_hot_reset_through_the_reset_file_goes_through_mindio_arf_bit_identically(tmp_path: Path,
                                                                                 long_reference: Path) -> None:
    code, output, plugin = hot_reset(tmp_path, "recovered")
    assert code == ExitCode.OK, output[-4000:]
    # The plugin reset the chip only after rank 1's process had left it (well within its 60 s).
    assert "rank 1 process left the chip" in plugin and "rank 1 recovered" in plugin, plugin
    gathered = {int(s) for s in re.findall(r"every rank waits after step (\d+); rank 1 leaves its chip", output)}
    assert len(gathered) == 1, output[-4000:]
    step = gathered.pop()
    assert "MindIO offers ['exit', 'dump', 'recover'] for fault ranks {1: 1}: recover" in output
    assert "rank 1 left its device for a hot reset" in output
    assert f"[rank 1] rank=1 rejoined through MindIO's ARF: resumed after step {step} (MindIO's repair step {step})" \
        in output, output[-4000:]
    assert f"[rank 0] rank=0 resumed after step {step} (MindIO's repair step {step})" in output
    assert_identical(tmp_path, long_reference, "train_mlp", 2)


def test_failed_hot_reset_ends_with_every_ranks_dying_gasp_of_one_step(tmp_path: Path) -> None:
    require_mindio()
    code, output, plugin = hot_reset(tmp_path, "failed")
    assert code == ExitCode.DUMPED, output[-4000:]
    assert "rank 1 failed" in plugin, plugin
    step = int(re.search(r"every rank waits after step (\d+)", output).group(1))
    assert "exit 3 (dying-gasp checkpoint written)" in output  # rank 0, told by MindIO to exit
    assert "rank 1 had no process; the agent wrote its dying-gasp checkpoint from memory" in output
    for rank in range(2):
        dumps = sorted((tmp_path / "dump").glob(f"mindft-rank{rank}-step*.ckpt"))
        assert [d.name for d in dumps] == [f"mindft-rank{rank}-step{step}.ckpt"], output[-4000:]
