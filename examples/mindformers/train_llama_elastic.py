"""MindFormers' Trainer in an elastic job: a pure data-parallel config that shrinks and grows.

    MS_ENABLE_TFT='{RSC:1}' mindft-launch --nnodes 2:3 --node-rank N --master-addr NODE0 \\
        --key-file keys.json examples/mindformers/train_llama_elastic.py \\
        --config examples/mindformers/tiny_llama.yaml

The yaml is the one ``train_llama.py`` trains (``parallel_mode: 0``: MindFormers takes
``data_parallel`` from the world size itself). What changes is the data: an elastic job's world
size changes between steps, so the Trainer is given ``mindft.mindspore.elastic_dataset`` over a
``GlobalBatches`` stream, where step ``s`` trains on the same ``--global-batch`` sequences whatever
the world, split over the ranks there are (three ranks of 4 sequences become two of 6), and
``mindft.mindformers.train`` re-enters the Trainer's ``Model.train`` at the stream's step after a
rollback or a change of world size. MindFormers' own dataset (sharded for one world size) is
refused under ``--nnodes MIN:MAX``.

``--steps``: stop after this step. ``--out DIR``: each rank writes its final parameters and AdamW
state to ``DIR/rank<R>.npz``. ``--record DIR``: one JSON line per completed step and process (as
``examples/train_elastic.py``). ``--load FILE --start K``: start from a state another run wrote
with ``--out`` after ``K`` steps, on the stream's step ``K + 1`` (a fault-free run that changes its
world size after step K). ``--step-seconds`` slows each step down.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mindspore as ms
import numpy as np
from mindformers import MindFormerConfig, Trainer, build_context
from mindspore.communication import get_group_size, get_rank
from mindspore.train import Callback

import mindft.mindformers
from mindft.mindspore import GlobalBatches, elastic_dataset
from train_llama import tokens  # registers the CPU training step the yaml names

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_elastic import ModelSteps, step_recorder  # noqa: E402


@dataclass(frozen=True)
class StreamAfter(GlobalBatches):
    """The stream from its step ``before + 1`` on: a run that goes on from another run's state."""

    before: int = 0

    def batch(self, step: int) -> np.ndarray:
        return super().batch(step + self.before)


class StateFiles(Callback):
    """Puts the state of ``load`` (a ``--out`` file) into the training network before its first step,
    and writes the network's final parameters, AdamW's moments included, to ``out/rank<R>.npz``."""

    def __init__(self, load: Optional[Path], out: Optional[Path]) -> None:
        super().__init__()
        self.load, self.out = load, out

    def on_train_begin(self, run_context) -> None:
        if self.load is not None:
            saved = np.load(self.load)
            for param in run_context.original_args().train_network.get_parameters():
                param.set_data(ms.Tensor(saved[param.name]))
            self.load = None  # once: Model.train is re-entered after a rollback

    def on_train_end(self, run_context) -> None:
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            network = run_context.original_args().train_network
            np.savez(self.out / f"rank{get_rank()}.npz", **{p.name: p.asnumpy() for p in network.get_parameters()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the yaml (examples/mindformers/tiny_llama.yaml)")
    parser.add_argument("--output-dir", help="overrides the yaml's output_dir")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=12, help="sequences per step, over every rank")
    parser.add_argument("--samples", type=int, default=120, help="sequences in the whole data set")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--record", type=Path)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--start", type=int, default=0, help="steps trained before (with --load)")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()
    config = MindFormerConfig(args.config)
    if args.output_dir:
        config.output_dir = args.output_dir
    build_context(config)  # before the Trainer: it would otherwise build one in PyNative mode

    sequences = tokens(config, args.samples)
    data = StreamAfter(args.samples, args.global_batch, config.seed, before=args.start)
    dataset = elastic_dataset(data, lambda indices: (sequences[indices],), ["input_ids"])  # mindft's line
    config.runner_config.epochs = -(-(args.steps - args.start) // dataset.get_dataset_size())
    steps = ModelSteps(sequences, args.start, args.steps, step_recorder(args.record, get_rank(), get_group_size()),
                       args.step_seconds)
    trainer = Trainer(args=config, task="text_generation", train_dataset=dataset,
                      callbacks=[steps, StateFiles(args.load, args.out)])
    mindft.mindformers.train(trainer)  # mindft's line


if __name__ == "__main__":
    main()
