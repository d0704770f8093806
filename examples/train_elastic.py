"""Elastic data-parallel training: a job that goes on with fewer nodes, every sample used once.

A hand-written data-parallel loop (examples/train_dp.py's network and data, gradients all-reduced by
``nn.DistributedGradReducer``) whose samples come from mindft's ``GlobalBatches``: each step trains
on the same global batch whatever the world size, split over the ranks there are. Started with
``--nnodes MIN:MAX``, a node lost for good leaves the job on the others::

    MS_ENABLE_TFT='{RSC:1}' mindft-launch --nnodes 2:3 --node-rank N --master-addr NODE0 \\
        --key-file keys.json examples/train_elastic.py --out /tmp/elastic

``--out DIR``: each rank writes its final parameters and optimizer state to ``DIR/rank<R>.npz``.
``--record DIR``: each process appends one JSON line per step it completes to
``DIR/steps-<pid>.jsonl`` (the step, its rank, the world size, the sample indices, the time), from
which the samples the job trained on can be checked. ``--load FILE --start K``: start from a state
another run wrote with ``--out`` after ``K`` steps (a fault-free run that changes its world size
after step K: K steps on one world, then the rest on another). ``--step-seconds`` slows each step
down, to leave time for a fault from outside. ``--api model`` trains the same steps with
``Model.train`` through ``mindft.mindspore.train``, from ``mindft.mindspore.elastic_dataset``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Optional

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Callback, Model

import mindft.mindspore
from mindft.mindspore import FaultTolerantLoop, GlobalBatches
from train_dp import CLASSES, FEATURES, HIDDEN, SyntheticClassification, save_weights


def load_state(path: Path, net: nn.Cell, optimizer: nn.Optimizer) -> None:
    """Put the parameters and optimizer state a run saved with ``--out`` back."""
    saved = np.load(path)
    for param in (*net.get_parameters(), *optimizer.get_parameters()):
        param.set_data(ms.Tensor(saved[param.name]))


class ModelSteps(Callback):
    """For ``Model.train``: slows each step down, records its samples (found from its first column's
    rows among ``samples``) and stops after step ``last`` (steps count from ``start``; mindft puts
    ``cur_step_num`` back after a rollback)."""

    def __init__(self, samples: np.ndarray, start: int, last: int, record, seconds: float) -> None:
        super().__init__()
        self.rows = {row.tobytes(): index for index, row in enumerate(samples)}
        self.start, self.last, self.record, self.seconds = start, last, record, seconds

    def on_train_step_begin(self, run_context) -> None:
        time.sleep(self.seconds)

    def on_train_step_end(self, run_context) -> None:
        params = run_context.original_args()
        step = self.start + params.cur_step_num
        self.record(step, np.array([self.rows[row.tobytes()] for row in params.train_dataset_element[0].asnumpy()]))
        if step >= self.last:
            run_context.request_stop()


def step_recorder(directory: Optional[Path], rank: int, world: int) -> Callable[[int, np.ndarray], None]:
    """``record(step, indices)``: one JSON line per completed step in ``directory/steps-<pid>.jsonl``
    (nothing without a directory)."""
    if directory is None:
        return lambda step, indices: None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"steps-{os.getpid()}.jsonl"

    def record(step: int, indices: np.ndarray) -> None:
        with path.open("a") as lines:
            lines.write(json.dumps({"step": step, "rank": rank, "world": world, "indices": indices.tolist(),
                                    "t": time.time()}) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--global-batch", type=int, default=12, help="samples per step, over every rank")
    parser.add_argument("--samples", type=int, default=120, help="in the whole data set")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--record", type=Path)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--start", type=int, default=0, help="steps trained before (with --load)")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--api", choices=("loop", "model"), default="loop",
                        help="a custom loop over shares, or Model.train over elastic_dataset")
    args = parser.parse_args()

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device(os.environ.get("DEVICE_TARGET", "CPU"))
    ms.set_deterministic(True)
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(args.seed)
    rank, world = get_rank(), get_group_size()

    source = SyntheticClassification(args.seed, args.samples)
    net = nn.SequentialCell(nn.Dense(FEATURES, HIDDEN), nn.ReLU(), nn.Dense(HIDDEN, CLASSES))
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    if args.load:
        load_state(args.load, net, optimizer)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    # Each rank's mean loss weighted by its share of the step (1.0 when the world divides the global batch).
    grad_fn = ms.value_and_grad(lambda x, y, weight: loss_fn(net(x), y) * weight, None, optimizer.parameters)
    reducer = nn.DistributedGradReducer(optimizer.parameters)
    recorded = step_recorder(args.record, rank, world)

    def train_step(step: int, indices: np.ndarray, weight: float) -> None:
        time.sleep(args.step_seconds)
        _, grads = grad_fn(ms.Tensor(source.x[indices]), ms.Tensor(source.y[indices]),
                           ms.Tensor(weight, ms.float32))
        optimizer(reducer(grads))
        recorded(step, indices)

    data = GlobalBatches(args.samples, args.global_batch, args.seed)
    if args.api == "model":
        dataset = mindft.mindspore.elastic_dataset(data, lambda indices: (source.x[indices], source.y[indices]),
                                                   ["x", "y"])
        model = Model(net, loss_fn, optimizer)
        per_epoch = dataset.get_dataset_size()
        first_epoch, skipped = divmod(args.start, per_epoch)
        dataset.set_init_step(skipped)  # a resume inside an epoch, as MindFormers' does
        steps = ModelSteps(source.x, args.start, args.steps, recorded, args.step_seconds)
        mindft.mindspore.train(model, math.ceil(args.steps / per_epoch), dataset, [steps],  # mindft's line
                               initial_epoch=first_epoch)
    else:
        with FaultTolerantLoop(net, optimizer) as loop:  # mindft's line
            for step, share in loop.shares(data, args.steps - args.start, start=args.start):
                loop.step(train_step, step, share.indices, share.weight)

    if args.out:
        save_weights(args.out, rank, net, optimizer)


if __name__ == "__main__":
    main()
