"""mindft-launch runs MindSpore's cluster as msrun does.

The same tutorial-style data-parallel script (examples/train_dp.py: ``init()``,
``DATA_PARALLEL``, a sharded data set, ``Model.train`` through mindft's one line) runs
under msrun and under mindft-launch with msrun's own flags, and ends bit-identical.
The msrun flag names are checked to mean what mindft's own names mean.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from mindft.net.keys import generate_keys
from harness import FAKE_RANK, LAUNCH_VARIABLES, ROOT, Processes, assert_identical, environment, free_port_pair, weights
from mindft.cli.launch import main
from mindft.agent.plan import LaunchSpec, UsageError, plan_launch, rank_environment, scheduler_environment

DP_SCRIPT = ROOT / "examples" / "train_dp.py"
PLAIN_SCRIPT = FAKE_RANK


def plan(argv: list[str], **environ: str) -> LaunchSpec:
    """The launch spec mindft-launch would run for ``argv`` (parsed by its own click command)."""
    params = main.make_context("mindft-launch", list(argv)).params
    return plan_launch(params, {"MS_ENABLE_TFT": "{RSC:1}", **environ})


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('a training script')\n")
    return path


def test_msrun_flags_on_one_node_parse_to_mindfts_own(clean_environment: None, script: Path, tmp_path: Path) -> None:
    common = ["--run-dir", str(tmp_path / "run")]
    ours = plan([*common, "--nproc", "2", "--master-addr", "127.0.0.1", "--master-port", "18118",
                 "--log-dir", str(tmp_path / "logs"), str(script), "--epochs", "3"])
    msrun = plan([*common, "--worker_num", "2", "--local_worker_num", "2", "--master_addr", "127.0.0.1",
                  "--master_port", "18118", "--node_rank", "-1", "--log_dir", str(tmp_path / "logs"),
                  "--join", "True", str(script), "--epochs", "3"])
    assert msrun == ours
    assert (ours.nproc, ours.nnodes, ours.node_rank) == (2, 1, 0)
    assert (ours.scheduler_port, ours.controller_port) == (18118, 18119)  # controller: --master-port + 1
    assert ours.runs_scheduler and ours.command[1:] == (str(script), "--epochs", "3")
    assert plan([*common, "--worker_num", "2", str(script)]).nproc == 2  # msrun's total alone: one node


def test_msrun_flags_on_two_nodes_parse_to_mindfts_own(clean_environment: None, script: Path,
                                                         tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    generate_keys(keys)
    common = ["--run-dir", str(tmp_path / "run"), "--key-file", str(keys)]
    ours = plan([*common, "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                 "--master-port", "29700", "--log-dir", str(tmp_path / "logs"), str(script)])
    msrun = plan([*common, "--worker_num", "4", "--local_worker_num", "2", "--node_rank", "1",
                  "--master_addr", "127.0.0.1", "--master_port", "29700", "--log_dir", str(tmp_path / "logs"),
                  "--join", "True", str(script)])
    assert msrun == ours
    assert (ours.world_size, list(ours.local_ranks)) == (4, [2, 3])
    assert ours.scheduler_port == 29700 and not ours.runs_scheduler  # node 1 only connects to it
    # MindSpore's own controller listens on MS_TFT_PORT under msrun: so does mindft's.
    assert plan([*common, "--worker_num", "4", "--local_worker_num", "2", "--master_port", "29700",
                 str(script)], MS_TFT_PORT="31000").controller_port == 31000


@pytest.mark.parametrize("argv, words", [
    (["--worker_num", "3", "--local_worker_num", "2"], ["--worker_num 3", "not a multiple", "2"]),
    (["--worker_num", "4", "--local_worker_num", "2", "--nnodes", "3"], ["makes 2 node(s)", "--nnodes is 3"]),
    (["--worker_num", "4", "--local_worker_num", "2", "--node_rank", "-1", "--insecure"],
     ["--node_rank -1", "not supported on several nodes"]),
    (["--master_port", "65535"], ["--master-port 65535", "MS_TFT_PORT"]),
    (["--bind_core", "True"], ["unknown option '--bind_core'", "--worker_num", "--join"]),
])
def test_impossible_msrun_command_lines_are_refused(clean_environment: None, script: Path, argv: list[str],
                                                     words: list[str]) -> None:
    with pytest.raises(UsageError) as refused:
        plan([*argv, str(script)])
    for word in words:
        assert word in str(refused.value)


def test_environment_of_workers_and_scheduler_is_msruns(clean_environment: None, script: Path,
                                                        tmp_path: Path) -> None:
    spec = plan(["--worker_num", "4", "--local_worker_num", "2", "--node_rank", "1", "--master_port", "29700",
                 "--cluster_time_out", "90", "--insecure", str(script)])
    worker = rank_environment(spec, 3, restart_count=1)
    assert {k: worker[k] for k in ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID",
                                   "RANK_ID", "RANK_SIZE", "DEVICE_ID", "MS_TOPO_TIMEOUT", "MS_ENABLE_RECOVERY",
                                   "MS_TFT_PORT")} == {
        "MS_ROLE": "MS_WORKER", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "29700", "MS_WORKER_NUM": "4",
        "MS_NODE_ID": "3", "RANK_ID": "3", "RANK_SIZE": "4", "DEVICE_ID": "1", "MS_TOPO_TIMEOUT": "90",
        "MS_ENABLE_RECOVERY": "1", "MS_TFT_PORT": "29701"}
    scheduler = scheduler_environment(spec)
    assert (scheduler["MS_ROLE"], scheduler["MS_SCHED_PORT"], scheduler["RANK_ID"]) == ("MS_SCHED", "29700", "0")
    assert "MS_NODE_ID" not in scheduler and scheduler["MS_ENABLE_RECOVERY"] == "1"
    unprotected = plan(["--nproc", "2", "--master_port", "18118", str(script)], MS_ENABLE_TFT="")
    assert "MS_ENABLE_RECOVERY" not in rank_environment(unprotected, 0, 0)  # exactly msrun's, unprotected
    no_cluster = plan(["--nproc", "2", "--no-scheduler", str(script)])
    assert no_cluster.scheduler_port is None and not no_cluster.runs_scheduler
    assert not {"MS_ROLE", "MS_SCHED_PORT"} & set(rank_environment(no_cluster, 0, 0))


HEARTBEAT = ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER")


@pytest.mark.parametrize("user, expected", [
    ({}, ("1", "1")),  # the cluster forms without MindSpore's 3..5 s heartbeat wait
    ({"MS_RETRY_INTERVAL_LOWER": "2", "MS_RETRY_INTERVAL_UPPER": "4"}, ("2", "4")),
    ({"MS_RETRY_INTERVAL_UPPER": "7"}, (None, "7")),  # half a pair: MindSpore's default completes it, not ours
    ({"MS_RETRY_INTERVAL_LOWER": ""}, ("", None)),  # set, even empty, is the user's
])
def test_heartbeat_interval_is_short_unless_the_user_set_one(clean_environment: None, script: Path,
                                                             user: dict[str, str],
                                                             expected: tuple[str | None, ...]) -> None:
    for argv, environ in ((["--nproc", "2", "--master_port", "18118", str(script)], {}),
                          (["--nproc", "2", "--master_port", "18118", str(script)], {"MS_ENABLE_TFT": ""})):
        spec = plan(argv, **environ, **user)
        for env in (rank_environment(spec, 1, restart_count=2), scheduler_environment(spec)):
            assert tuple(env.get(name) for name in HEARTBEAT) == expected


def test_heartbeat_interval_keeps_mindspores_defaults_on_a_large_cluster_and_without_a_scheduler(
        clean_environment: None, script: Path) -> None:
    large = plan(["--worker_num", "512", "--local_worker_num", "8", "--node_rank", "1", "--master_port", "18118",
                  "--insecure", str(script)])
    assert large.world_size == 512  # MindSpore sleeps in seconds above 256 workers: the interval paces its load
    assert not set(HEARTBEAT) & (set(rank_environment(large, 8, 0)) | set(scheduler_environment(large)))
    largest_short = plan(["--worker_num", "256", "--local_worker_num", "8", "--master_port", "18118",
                          "--insecure", str(script)])
    assert rank_environment(largest_short, 0, 0)["MS_RETRY_INTERVAL_LOWER"] == "1"
    no_cluster = plan(["--nproc", "2", "--no-scheduler", str(script)])
    assert not set(HEARTBEAT) & set(rank_environment(no_cluster, 0, 0))


# --- real jobs -------------------------------------------------------------------------------

@pytest.mark.mindspore
def test_dp_script_under_msrun_and_mindft_launch_ends_bit_identical(tmp_path: Path, processes: Processes) -> None:
    """Same flags, only the command name changes; MCCL all-reduces the gradients in both."""
    runs: dict[str, tuple[int, str]] = {}
    for command, env in (("msrun", environment(tmp_path)),
                         ("mindft-launch", environment(tmp_path, MS_ENABLE_TFT="{RSC:1}"))):
        port = free_port_pair()
        flags = ["--worker_num", "2", "--local_worker_num", "2", "--master_addr", "127.0.0.1",
                 "--master_port", str(port), "--log_dir", str(tmp_path / f"{command}-logs"), "--join", "True",
                 "--cluster_time_out", "120"]
        module = "mindspore.parallel.cluster.run" if command == "msrun" else "mindft.cli.launch"
        code, out = processes.run([sys.executable, "-m", module, *flags, str(DP_SCRIPT),
                                   "--out", str(tmp_path / f"{command}-out")], env, tmp_path / f"{command}.out")
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / f"{command}-logs").glob("*.log"))
        assert code == 0, f"{command} failed ({code}):\n{out[-3000:]}\n{logs}"
        runs[command] = code, out

    launched = runs["mindft-launch"][1]
    assert f"MindSpore scheduler 127.0.0.1:{port}" in launched and f"controller tcp://127.0.0.1:{port + 1}" in launched
    assert "all 2 ranks finished at step 32" in launched  # protected: registered, reported every step
    assert "after the job ended" not in launched  # the scheduler finished by itself once the ranks left
    assert (tmp_path / "mindft-launch-logs" / "scheduler.log").is_file()
    for rank in (0, 1):
        assert_identical(weights(tmp_path / "msrun-out", rank), weights(tmp_path / "mindft-launch-out", rank),
                          f"rank {rank}: msrun vs mindft-launch")
    # Each rank trained on its own shard: equal replicas mean the gradients really were all-reduced.
    ours = weights(tmp_path / "mindft-launch-out", 0)
    assert_identical(ours, weights(tmp_path / "mindft-launch-out", 1), "rank 0 vs rank 1")
    assert int(ours["global_step"].reshape(-1)[0]) == 32  # 256 samples / 2 ranks / batch 8, 2 epochs
    assert processes.leftovers() == []


@pytest.mark.mindspore
def test_a_dead_scheduler_fails_the_job_at_once(tmp_path: Path, processes: Processes) -> None:
    """Without its scheduler MindSpore's cluster cannot communicate: the launcher stops every rank, exit 1."""
    run_dir = tmp_path / "run"
    env = environment(tmp_path, PLAIN_SLEEP="120")  # ranks that would run for two minutes
    started = time.monotonic()
    launcher = processes.start([sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--run-dir", str(run_dir),
                                "--grace-period", "2", str(PLAIN_SCRIPT)], env, tmp_path / "launcher.out")
    job_file = run_dir / "job.json"
    while not job_file.exists() and time.monotonic() - started < 60 and launcher.poll() is None:
        time.sleep(0.1)
    assert job_file.exists(), (tmp_path / "launcher.out").read_text()
    info = json.loads(job_file.read_text())
    processes.remember(launcher.pid)
    os.kill(info["scheduler_pid"], signal.SIGKILL)
    code = launcher.wait(60)
    out = (tmp_path / "launcher.out").read_text()
    assert code == 1, out
    assert f"job failed: MindSpore's scheduler (pid {info['scheduler_pid']})" in out
    assert "SIGKILL" in out and str(run_dir / "logs" / "scheduler.log") in out
    assert "plain rank 0 done" not in out and "plain rank 1 done" not in out  # stopped, not waited for
    assert processes.leftovers() == []


@pytest.mark.mindspore
def test_a_scheduler_no_rank_joined_is_stopped_with_the_job(tmp_path: Path, processes: Processes) -> None:
    """Ranks that never call init() leave the scheduler waiting for nobody: it is stopped, not waited for."""
    code, out = processes.run([sys.executable, "-m", "mindft.cli.launch", "--nproc", "2", "--run-dir",
                               str(tmp_path / "run"), str(PLAIN_SCRIPT)], environment(tmp_path),
                              tmp_path / "launcher.out", timeout=120)
    assert code == 0, out
    assert "plain rank 0 done" in out and "plain rank 1 done" in out
    assert "started MindSpore's scheduler" in out and "after the job ended" not in out
    assert processes.leftovers() == []
