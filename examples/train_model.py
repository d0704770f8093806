"""The MLP of train_mlp.py trained with ``Model.train``, protected by mindft in one line.

``mindft.mindspore.train(model, epochs, dataset, callbacks)`` replaces
``model.train(epochs, dataset, callbacks)``: it adds the FaultTolerance callback and
re-enters ``Model.train`` at the right batch after a rollback. Same flags as
train_mlp.py (``--epochs`` instead of ``--steps``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.train import Model

import mindft.mindspore
from mindft.config import load_config
from mindft.rank.faults import DeviceFault

sys.path.insert(0, str(Path(__file__).parent))
# Same data, network, options and output as the custom-loop example.
from train_mlp import (add_common_arguments, build, configure_mindspore, save_weights,  # noqa: E402
                       synthetic_shard)


class Batches:
    """Random-access source of whole batches (fixed order: replay needs the same batch k)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self) -> int:
        return len(self.x) // self.batch_size

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start = index * self.batch_size
        return self.x[start:start + self.batch_size], self.y[start:start + self.batch_size]


def fault_hook(args: argparse.Namespace, rank: int, optimizer: nn.Optimizer):
    """Optimizer post-hook that fails once, after the update of --fault-step on --fault-rank."""
    fired = []

    def hook(cell: nn.Cell, inputs: object, outputs: object) -> None:
        step = int(optimizer.global_step.asnumpy().reshape(-1)[0])  # restored by rollbacks too
        if step != args.fault_step or rank != args.fault_rank or load_config().restart_count or fired:
            return
        fired.append(step)
        if args.fault_kind == "exit":
            os._exit(137)
        raise DeviceFault(detail=f"injected into rank {rank} at step {step}")
    return hook


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    add_common_arguments(parser)
    args = parser.parse_args(argv)

    configure_mindspore()
    config = load_config()
    x, y = synthetic_shard(args.seed, config.rank, config.world_size, args.samples)
    dataset = ds.GeneratorDataset(Batches(x, y, args.batch_size), ["x", "y"], shuffle=False)
    net, optimizer = build(args.seed)
    optimizer.register_forward_hook(fault_hook(args, config.rank, optimizer))
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer)

    mindft.mindspore.train(model, args.epochs, dataset)  # instead of model.train(args.epochs, dataset)

    if args.out:
        save_weights(args.out, config.rank, net, optimizer)


if __name__ == "__main__":
    main()
