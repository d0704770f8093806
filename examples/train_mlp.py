"""A small MLP trained with a hand-written MindSpore loop, protected by mindft.

Every rank trains its own shard of a synthetic data set (MindSpore's collective
communication cannot survive a rank restart on CPU), step-synchronized by mindft.
With a fixed seed the final weights are bit-identical whether or not a fault was
injected and recovered. Run one rank without mindft::

    python examples/train_mlp.py --steps 20 --out /tmp/mlp

or under mindft (controller + ranks, e.g. with mindft-launch) with
``MS_ENABLE_TFT='{UCE:1}'`` and a fault: ``--fault-step 7 --fault-rank 1 --fault-kind uce``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn

from mindft.config import load_config
from mindft.rank.faults import DeviceFault
from mindft.mindspore import FaultTolerantLoop

FEATURES, HIDDEN, CLASSES = 16, 32, 4


def synthetic_shard(seed: int, rank: int, world_size: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's rows of a fixed synthetic classification problem (a random teacher network)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples * world_size, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    return x[rank::world_size], y[rank::world_size]


def configure_mindspore() -> None:
    """CPU, deterministic kernels (MindSpore refuses to set these twice in one process)."""
    if not getattr(configure_mindspore, "done", False):
        ms.set_device("CPU")
        ms.set_deterministic(True)
        configure_mindspore.done = True


def build(seed: int) -> tuple[nn.Cell, nn.Optimizer]:
    """The network and its optimizer, initialised from ``seed`` (same on every rank)."""
    ms.set_seed(seed)
    net = nn.SequentialCell(nn.Dense(FEATURES, HIDDEN), nn.ReLU(), nn.Dense(HIDDEN, CLASSES))
    return net, nn.Adam(net.trainable_params(), learning_rate=1e-2)


_injected = []


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Data, seed, output and fault-injection options shared by both examples."""
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=128, help="samples per rank (one epoch)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write final weights to OUT/rank<R>.npz")
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--fault-kind", choices=("uce", "exit"), default="uce")


def save_weights(out: Path, rank: int, net: nn.Cell, optimizer: nn.Optimizer) -> None:
    """Final parameters and optimizer state, to compare runs bit for bit."""
    out.mkdir(parents=True, exist_ok=True)
    state = {p.name: p.asnumpy() for p in (*net.get_parameters(), *optimizer.get_parameters())}
    np.savez(out / f"rank{rank}.npz", **state)


def inject(args: argparse.Namespace, rank: int, step: int) -> None:
    """The test hook: fail once, in the first incarnation of --fault-rank, inside --fault-step."""
    if step != args.fault_step or rank != args.fault_rank or load_config().restart_count or _injected:
        return
    _injected.append(step)
    if args.fault_kind == "exit":
        os._exit(137)  # as if killed -9: no cleanup, no goodbye
    raise DeviceFault(detail=f"injected into rank {rank} at step {step}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    add_common_arguments(parser)
    args = parser.parse_args(argv)

    configure_mindspore()
    config = load_config()
    x, y = synthetic_shard(args.seed, config.rank, config.world_size, args.samples)
    per_epoch = len(x) // args.batch_size
    net, optimizer = build(args.seed)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = ms.value_and_grad(lambda xb, yb: loss_fn(net(xb), yb), None, optimizer.parameters)

    def make_batch(step: int) -> tuple[ms.Tensor, ms.Tensor]:
        start = (step - 1) % per_epoch * args.batch_size
        return ms.Tensor(x[start:start + args.batch_size]), ms.Tensor(y[start:start + args.batch_size])

    def train_step(step: int, xb: ms.Tensor, yb: ms.Tensor) -> float:
        loss, grads = grad_fn(xb, yb)
        optimizer(grads)
        inject(args, config.rank, step)  # after the update: the rollback must undo it
        return float(loss.asnumpy())

    with FaultTolerantLoop(net, optimizer) as loop:  # the mindft line
        for step, (xb, yb) in loop.batches(make_batch, args.steps):
            loss = loop.step(train_step, step, xb, yb)
            if loss is not None and step % 10 == 0:
                print(f"rank {config.rank} step {step} loss {loss:.4f}", flush=True)

    if args.out:
        save_weights(args.out, config.rank, net, optimizer)


if __name__ == "__main__":
    main()
