"""MindFormers' Trainer under mindft-launch, configured the way its users configure it.

examples/mindformers/train_llama.py trains a tiny random Llama from a yaml with MindFormers' own
Trainer, model, AdamW and train-step cell, in data parallel on 2 ranks (MCCL all-reduce). Faults
come from outside, as in production: ``mindft inject`` (a UCE raised at a rank's next step, a
SIGKILL) and the device plugin's hot reset. Under ``MS_ENABLE_TFT='{TTP:1}'`` the script holds no
mindft line: the Trainer appends MindSpore's own TrainFaultTolerance, which mindft-launch serves;
under ``'{RSC:1}'`` mindft's callback comes from the yaml or from ``mindft.mindformers.train``.
Every run must end with the final checkpoint of a run with mindft off, bit for bit: weights, AdamW
moments and the step counts MindFormers records in it. Without MindFormers these tests skip
locally and FAIL when CI is set (.ci/run installs it).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness import ROOT, Processes, environment, free_port_pair, require
from dp_jobs import wait_for_status

pytestmark = [pytest.mark.mindspore, pytest.mark.timeout(600)]

EXAMPLE = ROOT / "examples" / "mindformers"
# A rank silent for 5 s is hung: compiling the Llama graph of step 1 on 2 busy cores once left a
# rank's heartbeats 2 s apart (the injected faults are found from the process and the reset file).
FAST_FAULTS = {"MINDFT_HEARTBEAT_INTERVAL": "0.1", "MINDFT_HEARTBEAT_MISSES": "50", "MINDFT_STALL_TIMEOUT": "2",
               "MINDFT_RESET_POLL_INTERVAL": "0.1"}
# As docs/mindformers.md advises: workers fork from a process that imported MindFormers already.
PRELOAD = {"MINDFT_PRELOAD": "mindspore,mindformers"}


@pytest.fixture(scope="module", autouse=True)
def require_mindformers() -> None:
    require("mindformers", "MindFormers is not installed (docs/mindformers.md: Installing)")


def launch(processes: Processes, tmp: Path, name: str, tft: str, yaml: str = "tiny_llama.yaml",
           api: str = "none"):
    """mindft-launch --nproc 2 with the example; returns the launcher, its output file and run dir."""
    run_dir = tmp / name
    argv = [sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--master_port", str(free_port_pair()),
            "--run-dir", str(run_dir), "--cluster_time_out", "120", str(EXAMPLE / "train_llama.py"),
            "--config", str(EXAMPLE / yaml), "--output-dir", str(run_dir / "out"), "--mindft", api]
    # LOCAL_DEFAULT_PATH: where MindFormers logs before it reads the config (default ./output).
    env = environment(tmp, MS_ENABLE_TFT=tft, MINDFT_DUMP_DIR=str(run_dir / "dump"),
                      LOCAL_DEFAULT_PATH=str(run_dir / "out"), **FAST_FAULTS, **PRELOAD)
    output = tmp / f"{name}.out"
    return processes.start(argv, env, output), output, run_dir


def final_checkpoints(run_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    """Each rank's one checkpoint (MindFormers writes it when training ends), as arrays."""
    import mindspore as ms

    found = {}
    for rank in (0, 1):
        files = sorted((run_dir / "out" / "checkpoint" / f"rank_{rank}").glob("*.ckpt"))
        assert len(files) == 1, f"rank {rank}: one final checkpoint expected, found {[f.name for f in files]}"
        found[rank] = {name: value.asnumpy() for name, value in ms.load_checkpoint(str(files[0])).items()}
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, np.ndarray]]:
    """The final checkpoints of the same training with mindft off."""
    tmp = tmp_path_factory.mktemp("mindformers-reference")
    processes = Processes()
    try:
        launcher, output, run_dir = launch(processes, tmp, "plain", tft="")
        assert launcher.wait(300) == 0, output.read_text()[-4000:]
    finally:
        processes.kill_all()
    return final_checkpoints(run_dir)


def inject(job_file: Path, rank: int, fault: str, tmp: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mindft.cli.main", "inject", "--job", str(job_file), "--rank",
                             str(rank), "--fault", fault, "--recover-after", "1"],
                            env=environment(tmp), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


# The compatibility tier (MindFormers 1.8.0 on MindSpore 2.7.2) runs MindSpore's own callback and mindft's.
@pytest.mark.parametrize("tft, yaml, api, faults", [
    pytest.param("{TTP:1}", "tiny_llama.yaml", "none", ("uce", "kill"), marks=pytest.mark.compat),
    ("{TTP:1}", "tiny_llama.yaml", "none", ("hot-reset",)),
    pytest.param("{RSC:1}", "tiny_llama_rsc.yaml", "callback", ("uce", "kill"), marks=pytest.mark.compat),
    ("{RSC:1}", "tiny_llama.yaml", "train", ("hot-reset", "kill")),
], ids=["ttp-uce-kill", "ttp-hot-reset", "rsc-yaml-callback-uce-kill", "rsc-train-helper-hot-reset-kill"])
def test_the_trainer_recovers_bit_identically(tft: str, yaml: str, api: str, faults: tuple[str, ...],
                                              tmp_path: Path, processes: Processes, reference) -> None:
    launcher, output, run_dir = launch(processes, tmp_path, "run", tft, yaml, api)
    job_file = run_dir / "job.json"
    for number, fault in enumerate(faults):
        # The first fault once training runs (its first step compiles), each next one once the
        # job recovered from the one before: a rank of each, in turn.
        wait_for_status(job_file, launcher, output,
                  lambda s, n=number: s.state == "NORMAL" and s.recoveries == n and s.step >= 8,
                  f"training before fault {number + 1}")
        inject(job_file, 1 - number % 2, fault, tmp_path)
    code = launcher.wait(300)
    out = output.read_text()
    assert code == 0, out[-4000:]
    recoveries = len(faults)
    assert f"{recoveries} recover{'y' if recoveries == 1 else 'ies'})" in out, out[-4000:]
    if tft == "{TTP:1}":
        # MindSpore's own callback ran on mindft, not on MindIO (which refuses CPU).
        assert "serves MindSpore's TrainFaultTolerance on mindft" in out
        assert "MindIO adapter only support on Ascend" not in out
    got = final_checkpoints(run_dir)
    for rank, want in reference.items():
        assert sorted(got[rank]) == sorted(want)
        assert any(name.startswith("adam_m.") for name in want)  # AdamW's moments are compared too
        different = [name for name in want if got[rank][name].tobytes() != want[name].tobytes()]
        assert not different, f"rank {rank}: {different} differ from the run with mindft off"
    processes.remember_all()
    assert processes.leftovers() == []


def test_the_train_helper_builds_mindformers_context_from_the_trainers_config(tmp_path: Path) -> None:
    """Without a context built first, the Trainer would build one from an empty config, in PyNative
    mode, whatever the config says: mindft.mindformers.train builds it from the Trainer's config."""
    script = tmp_path / "train.py"
    script.write_text(f"""
import sys
import mindspore as ms
sys.path.insert(0, {str(EXAMPLE)!r})
from train_llama import token_dataset
from mindformers import MindFormerConfig, Trainer
import mindft.mindformers

config = MindFormerConfig({str(EXAMPLE / "tiny_llama.yaml")!r})
config.use_parallel = False
config.parallel_config.data_parallel = 1
config.runner_config.epochs = 1
config.output_dir = {str(tmp_path / "out")!r}
trainer = Trainer(args=config, task="text_generation", train_dataset=token_dataset(config))
mindft.mindformers.train(trainer)
print("trained in mode", ms.get_context("mode"))
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=environment(tmp_path, LOCAL_DEFAULT_PATH=str(tmp_path / "out")))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "trained in mode 0" in result.stdout, result.stdout[-2000:]  # GRAPH_MODE, as the yaml asks


@pytest.mark.parametrize("change, refused", [
    ({}, ""),
    ({"parallel_mode": 1}, "needs data parallelism, where every rank holds the whole state; parallel_mode is "
                           "semi_auto_parallel (the Trainer's parallel: section"),
    ({"enable_parallel_optimizer": True}, "cannot shard the optimizer state"),
    ({"dataset": "own"}, "this dataset, sharded for one world size, cannot follow it: build it with "
                         "mindft.mindspore.elastic_dataset"),
], ids=["data-parallel", "semi-auto", "sharded-optimizer", "its-own-dataset"])
def test_an_elastic_job_takes_a_pure_data_parallel_trainer_over_elastic_data_only(change: dict, refused: str) -> None:
    """Refused with one line before the Trainer builds its model: a parallel mode that shards the
    state, a sharded optimizer, a dataset sharded for one world size (the yaml's own included)."""
    from mindformers import MindFormerConfig

    from mindft.config import load_config
    from mindft.mindformers import elastic_problem
    from mindft.mindspore import GlobalBatches, elastic_dataset

    config = MindFormerConfig(str(EXAMPLE / "tiny_llama.yaml"))
    config.parallel.update({k: v for k, v in change.items() if k != "dataset"})
    elastic = load_config({"MINDFT_ELASTIC": "2:3", "RANK_ID": "0", "RANK_SIZE": "2"})
    dataset = None if "dataset" in change else elastic_dataset(
        GlobalBatches(24, 12), lambda indices: (np.zeros((len(indices), 4), np.int32),), ["input_ids"], elastic)
    said = elastic_problem(config, dataset, elastic)
    assert (refused in said and "\n" not in said) if refused else said == "", said
    assert elastic_problem(config, dataset, load_config({})) == ""  # not elastic: nothing to refuse
