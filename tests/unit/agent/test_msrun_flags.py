"""mindft-launch takes msrun's flags: each parses to what mindft's own names mean, the workers and
the scheduler get msrun's environment, impossible command lines are refused in one line (the
same script run under both: tests/integration/agent/test_cluster.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness import LAUNCH_VARIABLES
from mindft.agent.plan import LaunchSpec, UsageError, plan_launch, rank_environment, scheduler_environment
from mindft.cli.launch import main
from mindft.net.keys import generate_keys


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


def test_a_spare_runs_no_rank_until_it_is_given_a_node(clean_environment: None, script: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    generate_keys(keys)
    spare = plan(["--spare", "--nproc", "2", "--nnodes", "2", "--master-port", "29700", "--key-file", str(keys),
                  str(script)])
    assert (spare.spare, spare.node_rank, list(spare.local_ranks), spare.runs_scheduler) == (True, -1, [], False)
    assert spare.world_size == 4 and spare.controller_port == 29701


@pytest.mark.parametrize("argv, environ, words", [
    (["--node-rank", "1", "--nnodes", "2"], {}, ["--spare takes no --node-rank (got 1)"]),
    (["--nnodes", "1"], {}, ["--spare needs a job on several nodes"]),
    (["--nnodes", "2"], {"MS_ENABLE_TFT": ""}, ["--spare needs mindft's controller"]),
])
def test_a_spare_that_could_take_no_node_is_refused(clean_environment: None, script: Path, tmp_path: Path,
                                                   argv: list[str], environ: dict, words: list[str]) -> None:
    keys = tmp_path / "keys.json"
    generate_keys(keys)
    with pytest.raises(UsageError) as refused:
        plan(["--spare", *argv, "--key-file", str(keys), str(script)], **environ)
    assert all(word in str(refused.value) for word in words), str(refused.value)


def test_a_spare_pod_ignores_the_task_index_volcano_gives_it(clean_environment: None, script: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import mindft.cli.launch as launch

    keys = tmp_path / "keys.json"
    generate_keys(keys)
    seen = {}

    class Agent:
        def __init__(self, spec) -> None:
            seen["spec"] = spec

        def run(self) -> int:
            return 0

    monkeypatch.setattr(launch, "NodeAgent", Agent)
    result = CliRunner().invoke(launch.main, ["--spare", "--nnodes", "2", "--master-port", "29700", "--key-file",
                                              str(keys), "--run-dir", str(tmp_path / "run"), str(script)],
                                env={"VC_TASK_INDEX": "0", "MS_ENABLE_TFT": "{RSC:1}"})
    assert result.exit_code == 0, result.output
    assert seen["spec"].spare and seen["spec"].node_rank == -1
    refused = CliRunner().invoke(launch.main, ["--spare", "--node-rank", "1", "--nnodes", "2", "--key-file",
                                               str(keys), str(script)], env={"MS_ENABLE_TFT": "{RSC:1}"})
    assert refused.exit_code == 2 and "--spare takes no --node-rank (got 1)" in refused.output
