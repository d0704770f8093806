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

Each rank writes its final parameters and optimizer moments to ``OUT/rank<R>.npz``
(``--out``, or the ``TRAIN_DP_OUT`` environment variable); data parallelism keeps
the replicas identical, so every rank's file holds the same numbers.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Model

import mindft.mindspore

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--samples", type=int, default=256, help="in the whole data set")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=os.environ.get("TRAIN_DP_OUT") or None,
                        help="write final weights to OUT/rank<R>.npz [env: TRAIN_DP_OUT]")
    args = parser.parse_args(argv)

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.set_deterministic(True)
    init()  # MCCL on CPU; the scheduler process (MS_ROLE=MS_SCHED) serves the cluster here, then exits
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(args.seed)

    dataset = ds.GeneratorDataset(SyntheticClassification(args.seed, args.samples), ["x", "y"],
                                  num_shards=get_group_size(), shard_id=get_rank(), shuffle=False)
    dataset = dataset.batch(args.batch_size, drop_remainder=True)
    net = nn.SequentialCell(nn.Dense(FEATURES, HIDDEN), nn.ReLU(), nn.Dense(HIDDEN, CLASSES))
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer)

    mindft.mindspore.train(model, args.epochs, dataset)  # mindft's line, instead of model.train(...)

    if args.out:
        save_weights(args.out, get_rank(), net, optimizer)


if __name__ == "__main__":
    main()
