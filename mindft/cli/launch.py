"""``mindft-launch``: msrun's command line, run by mindft's node agent (:mod:`mindft.agent.shell`).

It runs MindSpore's cluster as msrun does (the scheduler on node 0, the workers'
``MS_ROLE``/``MS_SCHED_*`` environment, msrun's flag names as synonyms: what to run is
planned by :mod:`mindft.agent.plan`) and plays the role msrun hands to MindCluster's
external agent when ``MS_ENABLE_TFT`` asks for fault tolerance: kill a worker, start all,
start a list, monitor, as the job's controller and the node's policy
(:mod:`mindft.flow.agent`) decide.

Ports: MindSpore's scheduler listens on ``--master-port`` (msrun's ``--master_port``);
mindft's controller on ``MS_TFT_PORT`` when set (where MindSpore's own fault-tolerance
controller listens under msrun), else on ``--master-port`` + 1.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from mindft.agent.memory import KEY_PREFIX, private_memory
from mindft.agent.shell import NodeAgent
from mindft.config import ConfigError
from mindft.exitcodes import ExitCode, describe, help_block
from mindft.net.keys import generate_keys
from mindft.agent.plan import (DEFAULT_CLUSTER_TIME_OUT, DEFAULT_GRACE_PERIOD, DEFAULT_PROGRESS_INTERVAL, JOB_FILE,
                               LaunchSpec, UsageError, plan_launch)

log = logging.getLogger(__name__)


def job_verdict(code: int) -> str:
    """The launcher's last line: its exit code and what it means."""
    if 128 < code < 128 + 65:
        try:
            return f"exit code {code}: interrupted by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    meaning = describe(code)
    return f"exit code {code}" if meaning == f"exit code {code}" else f"exit code {code}: {meaning}"


# The tag of each line the launcher's process logs, as before the modules moved into packages
# (people and docs grep for them): the node agent speaks as mindft-launch, the controller that
# runs in node 0's agent as controller, a moved module by its old name, any other by its own.
_PACKAGE_TAGS = {"mindft.agent": "mindft-launch", "mindft.controller": "controller"}
_MODULE_TAGS = {"mindft.cli.launch": "mindft-launch", "mindft.agent.gasp": "agent_gasp", "mindft.agent.warm": "warm",
                "mindft.agent.zygote": "zygote", "mindft.device.watch": "resetwatch",
                "mindft.device.simulator": "plugin_sim", "mindft.net.address": "ports", "mindft.rank.engine": "rank",
                "mindft.snapshot.store": "snapshot"}


def log_tag(logger: str) -> str:
    """The ``[tag]`` in front of a line that ``logger`` (a module's ``__name__``) logs in the launcher."""
    package, _, module = logger.rpartition(".")
    return _MODULE_TAGS.get(logger) or _PACKAGE_TAGS.get(package, module)


def _setup_logging(verbose: bool) -> None:
    class _Tagged(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            tag = log_tag(record.name)
            level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
            return f"[{tag}] {level}{record.getMessage()}" + (
                "\n" + self.formatException(record.exc_info) if record.exc_info else "")

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Tagged())
    root = logging.getLogger("mindft")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


_HELP = """Run SCRIPT [ARGS] as NPROC ranks with mindft fault tolerance.

Runs MindSpore's cluster as msrun does: on node 0 the scheduler
(MS_ROLE=MS_SCHED), then the workers with the environment msrun sets
(MS_ROLE=MS_WORKER, MS_SCHED_HOST/PORT, MS_WORKER_NUM, MS_NODE_ID, RANK_ID,
RANK_SIZE, DEVICE_ID; MS_ENABLE_RECOVERY=1 with fault tolerance on, so a
restarted worker rejoins) plus MS_TFT_IP/MS_TFT_PORT and MINDFT_KEY_FILE.
msrun's option names are accepted too: change the command name and keep
the rest. Node 0 also runs mindft's controller and its watcher of the
device plugin's reset file. Each rank's output is printed prefixed with
[rank N]; a crashed rank is restarted up to --max-restarts times (an
exception from the script is not retried); the launcher exits with the
job's result.

""" + help_block()


def _fail(message: str) -> None:
    click.echo(f"mindft-launch: {message}", err=True)
    sys.exit(ExitCode.USAGE)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                 "help_option_names": ["-h", "--help"]}, help=_HELP)
@click.option("--nproc", "--local_worker_num", "nproc", type=click.IntRange(1, 4096), default=None,
              envvar="MINDFT_NPROC", help="Ranks to start on this node. [default: 1, or --worker_num / --nnodes]")
@click.option("--nnodes", default=None, envvar="MINDFT_NNODES", metavar="N|MIN:MAX",
              help="Nodes in the job; MIN:MAX (torchrun's syntax): a data-parallel job of MAX nodes that goes on "
                   "with fewer, down to MIN, when a node is lost for good (see --shrink-after). "
                   "[default: 1, or --worker_num / --local_worker_num]")
@click.option("--shrink-after", "shrink_after", type=click.FloatRange(0, 86400), default=None,
              envvar="MINDFT_SHRINK_AFTER",
              help="With --nnodes MIN:MAX: seconds a lost node is waited for (its launcher again, or a spare) "
                   "before the job goes on without it. [default: 30]")
@click.option("--worker_num", "--worker-num", "worker_num", type=click.IntRange(1), default=None,
              help="msrun's name: ranks in the whole job (--nproc x --nnodes).")
@click.option("--node-rank", "--node_rank", "node_rank", type=click.IntRange(-1), default=None,
              envvar=["MINDFT_NODE_RANK", "VC_TASK_INDEX"],
              help="This node's index; node 0 runs the controller and MindSpore's scheduler (-1, msrun's "
                   "default, means 0 on one node). [default: 0; env: MINDFT_NODE_RANK, VC_TASK_INDEX]")
@click.option("--spare", is_flag=True,
              help="Start a warm spare node for the job (same --nproc, --nnodes, --master-addr, --key-file; no "
                   "--node-rank): its node agent and warm process wait, and when a node is lost the controller "
                   "gives it that node's ranks, restored from their replicas on the next node.")
@click.option("--standbys", type=click.IntRange(0, 2), default=0, show_default=True, envvar="MINDFT_STANDBYS",
              help="Nodes after node 0 (1, or 1 and 2) that stand by for the controller: when node 0 is lost, the "
                   "first of them takes command, rebuilds the job from the agents' memory and runs MindSpore's "
                   "scheduler (give every node the same value).")
@click.option("--master-addr", "--master_addr", "master_addr", default="127.0.0.1", show_default=True,
              envvar="MINDFT_MASTER_ADDR",
              help="Address of node 0 (IP or host name); the scheduler and the controller listen there.")
@click.option("--master-port", "--master_port", "master_port", type=click.IntRange(0, 65535), default=None,
              envvar="MINDFT_MASTER_PORT",
              help="MindSpore's scheduler port (MS_SCHED_PORT, as msrun's). The controller listens on "
                   "MS_TFT_PORT if set, else on this port + 1. Default: free ports on one node, 29600 on several.")
@click.option("--scheduler/--no-scheduler", default=True, show_default=True, envvar="MINDFT_SCHEDULER",
              help="Run MindSpore's cluster as msrun does (scheduler on node 0, MS_ROLE/MS_SCHED_* in the "
                   "ranks); --no-scheduler for a script that never calls mindspore.communication.init().")
@click.option("--cluster-time-out", "--cluster_time_out", "cluster_time_out", type=int,
              default=DEFAULT_CLUSTER_TIME_OUT, show_default=True,
              help="Seconds for MindSpore's cluster to form (MS_TOPO_TIMEOUT, as msrun's); negative: forever.")
@click.option("--join", type=click.BOOL, default=None,
              help="Accepted for msrun compatibility; mindft-launch always stays with the job.")
@click.option("--max-restarts", type=click.IntRange(0, 1000), default=3, show_default=True,
              help="Times each rank may be restarted (a restart of every worker counts; a hot reset's does not).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Private directory for the key file, logs and job.json. Default: a new temporary one.")
@click.option("--log-dir", "--log_dir", "log_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Per-rank log files (rank_N.log) and scheduler.log. Default: RUN_DIR/logs.")
@click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              envvar="MINDFT_KEY_FILE",
              help="Use this job key (from 'mindft keygen'), shared by every node. Default: a new one.")
@click.option("--insecure", is_flag=True, help="Run the control channel without CurveZMQ (debugging only).")
@click.option("--grace-period", type=click.FloatRange(0), default=DEFAULT_GRACE_PERIOD, show_default=True,
              help="Seconds between forwarding SIGINT/SIGTERM and SIGKILL.")
@click.option("--progress-interval", type=click.FloatRange(0.1), default=DEFAULT_PROGRESS_INTERVAL,
              show_default=True, help="Seconds between progress lines while a recovery waits.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, envvar="MINDFT_METRICS_PORT",
              help="Serve this node's Prometheus metrics at http://ADDR:PORT/metrics, on node 0 with the "
                   "controller's and the live status page at http://ADDR:PORT/ (docs/metrics.md). [default: off]")
@click.option("--metrics-addr", default=None, envvar="MINDFT_METRICS_ADDR",
              help="Address the metrics are served on (0.0.0.0: every interface). [default: --master-addr on node 0, elsewhere the address that reaches it]")
@click.option("--no-prefix", is_flag=True, help="Do not prefix rank output with [rank N].")
@click.option("--console-mindspore-logs", is_flag=True, envvar="MINDFT_CONSOLE_MINDSPORE_LOGS",
              help="Show MindSpore's own INFO and WARNING log lines on the console too; by default they go "
                   "only to each rank's log file (LOG_DIR/rank_N.log), as msrun's do. Its errors always show.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging of mindft itself.")
@click.version_option(package_name="mindft", message="mindft %(version)s")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def main(**params: Any) -> None:
    """``mindft-launch``: plan the launch from the command line, run the node agent, exit with the job's code."""
    _setup_logging(params["verbose"])
    if params["spare"] and click.get_current_context().get_parameter_source("node_rank") is ParameterSource.ENVIRONMENT:
        params["node_rank"] = None  # a spare pod's VC_TASK_INDEX (its own task's) names no node of the job
    try:
        spec = plan_launch(params, os.environ)
    except UsageError as error:
        _fail(str(error))
    except ConfigError as error:
        _fail(f"configuration error: {error}")
    if params["join"] is False:
        log.warning("--join False: mindft-launch stays with the job anyway (it restarts ranks and "
                    "decides the exit code)")
    # Created only once everything is validated, so a refused launch leaves nothing behind.
    run_dir = params["run_dir"]
    made_run_dir = run_dir is None
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix="mindft-run-"))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, 0o700)
    generated_key = spec.protected and not spec.insecure and spec.key_file is None
    key_file = spec.key_file
    if generated_key:
        # In memory, marked as this launcher's: a launcher that is killed leaves no usable key on disk,
        # and the next launcher on the host removes it (mindft.agent.memory.remove_stale_memory).
        key_file = private_memory(KEY_PREFIX) / "keys.json"
        generate_keys(key_file)
    spec = dataclasses.replace(spec, run_dir=run_dir, log_dir=params["log_dir"] or run_dir / "logs",
                               key_file=key_file)
    try:
        code = NodeAgent(spec).run()
    except ConfigError as error:
        clean_run_dir(spec, made_run_dir, generated_key)
        _fail(f"configuration error: {error}")
    clean_run_dir(spec, made_run_dir, generated_key)
    print(f"[mindft-launch] {job_verdict(code)}", flush=True)
    sys.exit(code)


def clean_run_dir(spec: LaunchSpec, made_run_dir: bool, generated_key: bool) -> None:
    """After the job: keep the logs, drop what only a running job needs.

    The generated key (a secret, in memory) and job.json (it names a controller that is gone) are
    removed; a run directory this launcher created is removed whole when it holds no log.
    """
    if generated_key and spec.key_file is not None:
        shutil.rmtree(spec.key_file.parent, ignore_errors=True)
    try:
        (spec.run_dir / JOB_FILE).unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        log.warning("could not remove %s: %s", spec.run_dir / JOB_FILE, error)
    logs = [p for p in spec.log_dir.glob("*") if p.is_file()] if spec.log_dir.is_dir() else []
    if logs:
        print(f"[mindft-launch] logs kept in {spec.log_dir}", flush=True)
    elif made_run_dir:
        shutil.rmtree(spec.run_dir, ignore_errors=True)


if __name__ == "__main__":
    # Run the copy in sys.modules so loggers and classes are mindft.cli.launch's, not __main__'s.
    from mindft.cli.launch import main as _main
    _main()
