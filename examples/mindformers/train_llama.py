"""Train a tiny random Llama with MindFormers' Trainer from a yaml, as MindFormers users do.

    MS_ENABLE_TFT='{TTP:1}' mindft-launch --nproc 2 examples/mindformers/train_llama.py \\
        --config examples/mindformers/tiny_llama.yaml

Under ``TTP:1`` the script needs nothing of mindft's: the Trainer appends MindSpore's own
``TrainFaultTolerance``, which ``mindft-launch`` serves. Under ``MS_ENABLE_TFT='{RSC:1}'`` pick how
mindft's callback gets in: ``--mindft callback`` imports :mod:`mindft.mindformers` and lets the
yaml name it (``- type: MindftFaultTolerance`` under ``callbacks:``, as in ``tiny_llama_rsc.yaml``); ``--mindft train`` calls
``mindft.mindformers.train(trainer)``. The data is 64 random sequences, the same on every run,
split between the data-parallel ranks; the final checkpoint lands in ``OUTPUT_DIR/checkpoint``.
"""
from __future__ import annotations

import argparse

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindformers import MindFormerConfig, Trainer, build_context
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindformers.wrapper import MFTrainOneStepCell
from mindspore.communication import get_group_size, get_rank


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class CPUTrainOneStepCell(MFTrainOneStepCell):
    """MindFormers' training step with an overflow check that CPU has kernels for."""

    def get_overflow_status(self, status, compute_output):
        finite = [ms.ops.isfinite(grad).all() for grad in compute_output]
        return ms.ops.logical_not(ms.ops.stack(finite).all())


def tokens(config: MindFormerConfig, samples: int = 64) -> np.ndarray:
    """``samples`` random sequences of seq_length + 1 tokens, the same on every run."""
    model = config.model.model_config
    return np.random.default_rng(0).integers(0, model.vocab_size, size=(samples, model.seq_length + 1),
                                             dtype=np.int32)


def token_dataset(config: MindFormerConfig) -> ds.Dataset:
    """64 random sequences, this rank's share of them, in batches."""
    shard = {"num_shards": get_group_size(), "shard_id": get_rank()} if config.use_parallel else {}
    return ds.NumpySlicesDataset({"input_ids": tokens(config)}, shuffle=False, **shard).batch(
        config.runner_config.batch_size, drop_remainder=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the yaml (examples/mindformers/tiny_llama.yaml)")
    parser.add_argument("--output-dir", help="overrides the yaml's output_dir")
    parser.add_argument("--mindft", choices=("none", "callback", "train"), default="none",
                        help="how mindft's own callback gets in (RSC:1); none under TTP:1")
    args = parser.parse_args()
    config = MindFormerConfig(args.config)
    if args.output_dir:
        config.output_dir = args.output_dir
    if args.mindft == "callback":
        import mindft.mindformers  # noqa: F401 - registers MindftFaultTolerance, which the yaml names
    build_context(config)  # before the Trainer: it would otherwise build one in PyNative mode
    trainer = Trainer(args=config, task="text_generation", train_dataset=token_dataset(config))
    if args.mindft == "train":
        import mindft.mindformers

        mindft.mindformers.train(trainer)
    else:
        trainer.train()


if __name__ == "__main__":
    main()
