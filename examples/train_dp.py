"""Data-parallel training as in MindSpore's tutorials, plus mindft's one line.

An unmodified tutorial-style script: ``mindspore.communication.init()``,
``ParallelMode.DATA_PARALLEL`` with ``gradients_mean=True``, a data set sharded by
rank, ``Model.train`` (MindSpore all-reduces the gradients). The only mindft line is
``mindft.mindspore.train(model, epochs, dataset)`` instead of ``model.train(epochs,
dataset)``. It runs the same under msrun and under mindft-launch::

    msrun --worker_num 2 --local_worker_num 2 --master_port 8118 --join True \\
          examples/train_dp.py --out /tmp/dp
    MS_ENABLE_TFT='{RSC:1}' mindft-launch --worker_num 2 --local_worker_num 2 \\
          --master_port 8118 examples/train_dp.py --out /tmp/dp

The device is ``--device-target`` (default: the ``DEVICE_TARGET`` environment variable, else
CPU): examples/k8s/volcano-job.yaml runs this script on Ascend.

Each rank writes its final parameters and optimizer moments to ``OUT/rank<R>.npz``
(``--out``, or the ``TRAIN_DP_OUT`` environment variable); data parallelism keeps
the replicas identical, so every rank's file holds the same numbers.

``--loop`` trains the same model with a hand-written loop instead (gradients
all-reduced by ``nn.DistributedGradReducer``, mindft's ``FaultTolerantLoop``);
``--callback`` calls ``model.train`` itself with mindft's ``FaultTolerance`` callback;
``--mindspore-tft`` with MindSpore's own ``TrainFaultTolerance`` instead, its optimizer wrapped by
``TrainFaultTolerance.get_optimizer_wrapper``, as MindSpore's docs show (run it with
``MS_ENABLE_TFT='{TTP:1}'``: mindft-launch serves that callback without MindIO).
``--fault-kind bug`` raises a ``ValueError`` in the same step of every incarnation, as a bug
in the script would, and ``exit-always`` exits there in every incarnation.
``--fault-step/--fault-rank/--fault-kind`` inject one fault into the first incarnation
of a rank, inside the step before its all-reduce (``uce``: a device error; ``kill``: SIGKILL;
``exit``: ``os._exit(137)``; ``stop``: the process stops itself, as a hang), or after it (``uce-after``: a
device error raised once the optimizer has applied the all-reduced gradients: every other rank
reaches the step's end, where mindft holds it until every rank finished the step, so the job
rolls back in place). ``--step-seconds`` slows
each step down, to leave time for faults injected from outside. ``--timeline`` prints
``timeline ...`` lines (wall-clock times of start, imports, ``init()``, restore, each step)
that bench/recovery.py reads.

``--resume DUMP_DIR...`` (with ``--loop``) starts from the dying gasps of a job that could not
go on: the node agents' manifests in those directories name each rank's checkpoint at one
step; each rank loads its own and trains the steps left (docs/usage.md, "When the job cannot
continue").
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Model, TrainFaultTolerance

import mindft.mindspore
from mindft.config import load_config
from mindft.rank.faults import DeviceFault

FEATURES, HIDDEN, CLASSES = 16, 32, 4


class SyntheticClassification:
    """A fixed classification problem (labels from a random teacher network), one sample per index."""

    def __init__(self, seed: int, samples: int) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((samples, FEATURES)).astype(np.float32)
        teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
        self.y = np.argmax(self.x @ teacher, axis=1).astype(np.int32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        # Arrays, not NumPy scalars: MindSpore's GeneratorDataset cannot wrap a scalar without a copy.
        return self.x[index], np.asarray(self.y[index])


def save_weights(out: Path, rank: int, net: nn.Cell, optimizer: nn.Optimizer) -> None:
    """Final parameters and optimizer state (Adam's moments), to compare runs bit for bit."""
    out.mkdir(parents=True, exist_ok=True)
    state = {p.name: p.asnumpy() for p in (*net.get_parameters(), *optimizer.get_parameters())}
    np.savez(out / f"rank{rank}.npz", **state)


class Timeline:
    """``timeline rank=R restart=I event=E t=WALL [step=S]`` lines on stderr, when enabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, event: str, step: int | None = None, at: float | None = None) -> None:
        if self.enabled:
            print(f"timeline rank={os.environ.get('RANK_ID', '0')} restart={load_config().restart_count} "
                  f"event={event} t={time.time() if at is None else at:.6f}"
                  + ("" if step is None else f" step={step}"), file=sys.stderr, flush=True)

    def started(self) -> None:
        """``created`` (when this process started, from /proc: 10 ms resolution) and ``imported`` (now)."""
        try:
            ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
            age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
            self("created", at=time.time() - age)
        except (OSError, ValueError, IndexError, AttributeError):
            pass  # not Linux: no process start time
        self("imported")


def fault_drill(args: argparse.Namespace, optimizer: nn.Optimizer, timeline: Timeline):
    """A forward pre-hook: in step --fault-step of --fault-rank's first incarnation, before the
    step's all-reduce, fail as --fault-kind says; every step sleeps --step-seconds first."""
    rank, first_incarnation, fired = get_rank(), load_config().restart_count == 0, []
    every_incarnation = args.fault_kind in ("bug", "exit-always")

    def hook(cell: nn.Cell, inputs: object) -> None:
        time.sleep(args.step_seconds)
        step = int(optimizer.global_step.asnumpy().reshape(-1)[0]) + 1  # the step being computed
        if (step != args.fault_step or rank != args.fault_rank or not (first_incarnation or every_incarnation)
                or args.fault_kind == "uce-after" or (fired and not every_incarnation)):
            return
        fired.append(step)  # a device fault strikes once: a rollback in place replays the step
        timeline("fault", step)
        if args.fault_kind == "bug":
            raise ValueError(f"a bug in the training script, in step {step} of rank {rank}")
        if args.fault_kind == "exit-always":
            os._exit(1)
        if args.fault_kind == "exit":
            os._exit(137)  # as if killed -9, with an exit code a parent can check
        if args.fault_kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fault_kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # hangs until killed
        raise DeviceFault(detail=f"injected into rank {rank} in step {step}, before its all-reduce")
    return hook


def fault_after_update(args: argparse.Namespace, optimizer: nn.Optimizer, timeline: Timeline):
    """An optimizer forward post-hook: once, after the update of --fault-step on --fault-rank
    (the step's all-reduce is done on every rank), raise a device error."""
    rank, fired = get_rank(), []

    def hook(cell: nn.Cell, inputs: object, outputs: object) -> None:
        step = int(optimizer.global_step.asnumpy().reshape(-1)[0])  # already counted by the update
        if step != args.fault_step or rank != args.fault_rank or load_config().restart_count or fired:
            return
        fired.append(step)  # a rollback in place replays this step in the same process
        timeline("fault", step)
        raise DeviceFault(detail=f"injected into rank {rank} in step {step}, after its all-reduce")
    return hook


def build(args: argparse.Namespace) -> tuple[ds.Dataset, nn.Cell, nn.Optimizer]:
    """This rank's shard of the data set, the network and its optimizer."""
    dataset = ds.GeneratorDataset(SyntheticClassification(args.seed, args.samples), ["x", "y"],
                                  num_shards=get_group_size(), shard_id=get_rank(), shuffle=False)
    dataset = dataset.batch(args.batch_size, drop_remainder=True)
    net = nn.SequentialCell(nn.Dense(FEATURES, HIDDEN), nn.ReLU(), nn.Dense(HIDDEN, CLASSES))
    adam = TrainFaultTolerance.get_optimizer_wrapper(nn.Adam) if args.mindspore_tft else nn.Adam
    optimizer = adam(net.trainable_params(), learning_rate=1e-2)
    return dataset, net, optimizer


def loop_step(net: nn.Cell, optimizer: nn.Optimizer):
    """One step of the hand-written loop: gradients all-reduced by DistributedGradReducer, then applied."""
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)
    grad_reducer = nn.DistributedGradReducer(optimizer.parameters)

    def train_step(x: ms.Tensor, y: ms.Tensor) -> None:
        _, grads = grad_fn(x, y)
        optimizer(grad_reducer(grads))
    return train_step


def train_loop(net: nn.Cell, optimizer: nn.Optimizer, dataset: ds.Dataset, epochs: int,
               timeline: Timeline, first: int = 0) -> None:
    """The same training as a hand-written loop: MindSpore's DistributedGradReducer all-reduces.
    ``first``: the steps already trained (a resume): the loop goes on with the batch after them."""
    train_step = loop_step(net, optimizer)
    batches = list(dataset.create_tuple_iterator(num_epochs=1))
    per_epoch = len(batches)
    timeline("built")

    with mindft.mindspore.FaultTolerantLoop(net, optimizer) as loop:  # mindft's line
        timeline("ready", loop.position)
        for step, (x, y) in loop.batches(lambda step: batches[(first + step - 1) % per_epoch],
                                         epochs * per_epoch - first):
            loop.step(train_step, x, y)
            timeline("step", loop.position)  # after a rollback in place: the step rolled back to


def resume(paths: list[Path], net: nn.Cell, optimizer: nn.Optimizer) -> int:
    """Load this rank's dying gasp into the network and the optimizer; returns its step.

    ``paths``: the dump directories (or manifests) the nodes' agents wrote their dying gasps to:
    every ``mindft-dying-gasp-node<N>.json`` names each rank's ``.ckpt`` and where it came from;
    the newest step every rank has one of is loaded."""
    import dataclasses
    import json

    from mindft.flow.gasp import read_manifest, resume_point

    manifests = []
    for path in paths:
        for found in [path] if path.is_file() else sorted(path.glob("mindft-dying-gasp-node*.json")):
            step, world, entries = read_manifest(json.loads(found.read_text()))
            manifests.append((step, world, {rank: dataclasses.replace(entry, file=str(found.parent / entry.file))
                                            for rank, entry in entries.items()}))
    step, files = resume_point(manifests, get_group_size())
    checkpoint = ms.load_checkpoint(files[get_rank()].file)
    for cell in (net, optimizer):
        not_loaded, _ = ms.load_param_into_net(cell, checkpoint)
        if not_loaded:
            raise ValueError(f"{files[get_rank()].file} holds no {', '.join(not_loaded)}")
    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--samples", type=int, default=256, help="in the whole data set")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device-target", choices=("CPU", "Ascend", "GPU"),
                        default=os.environ.get("DEVICE_TARGET", "CPU"),
                        help="MindSpore's device (default: the DEVICE_TARGET environment variable, else CPU)")
    parser.add_argument("--out", type=Path, default=os.environ.get("TRAIN_DP_OUT") or None,
                        help="write final weights to OUT/rank<R>.npz [env: TRAIN_DP_OUT]")
    parser.add_argument("--loop", action="store_true", help="a hand-written loop instead of Model.train")
    parser.add_argument("--resume", type=Path, nargs="+", metavar="DUMP_DIR",
                        help="with --loop: start from the dying gasps mindft wrote to these directories")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long in every step")
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--callback", action="store_true", help="model.train with mindft's FaultTolerance callback")
    parser.add_argument("--mindspore-tft", action="store_true",
                        help="model.train with MindSpore's own TrainFaultTolerance callback (MS_ENABLE_TFT='{TTP:1}')")
    parser.add_argument("--fault-kind", choices=("uce", "kill", "exit", "stop", "uce-after", "bug", "exit-always"),
                        default="uce")
    parser.add_argument("--timeline", action="store_true", help="print timeline lines for bench/recovery.py")
    args = parser.parse_args(argv)
    timeline = Timeline(args.timeline)
    timeline.started()

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device(args.device_target)
    ms.set_deterministic(True)
    init()  # MCCL on CPU; the scheduler process (MS_ROLE=MS_SCHED) serves the cluster here, then exits
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(args.seed)
    timeline("initialized")

    dataset, net, optimizer = build(args)
    if args.step_seconds or args.fault_step >= 0:
        net.register_forward_pre_hook(fault_drill(args, optimizer, timeline))
    if args.fault_step >= 0 and args.fault_kind == "uce-after":
        optimizer.register_forward_hook(fault_after_update(args, optimizer, timeline))

    if args.resume and not args.loop:
        parser.error("--resume needs --loop: its steps are numbered, Model.train starts at an epoch")
    if args.loop:
        train_loop(net, optimizer, dataset, args.epochs, timeline, resume(args.resume, net, optimizer)
                   if args.resume else 0)
    elif args.callback:
        model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer)
        model.train(args.epochs, dataset, callbacks=[mindft.mindspore.FaultTolerance()], dataset_sink_mode=False)
    elif args.mindspore_tft:
        model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer)
        dumps = str(args.out or Path("."))
        model.train(args.epochs, dataset, callbacks=[TrainFaultTolerance(ckpt_save_path=dumps)], dataset_sink_mode=False)
    else:
        model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer)
        mindft.mindspore.train(model, args.epochs, dataset)  # mindft's line, instead of model.train(...)

    if args.out:
        save_weights(args.out, get_rank(), net, optimizer)


if __name__ == "__main__":
    main()
