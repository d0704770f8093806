"""Which samples each rank trains on at each step, so that a job whose world size changes (an elastic
job, :mod:`mindft.flow.elastic`) still uses every sample of every epoch exactly once.

The data is a stream: the data set's indices in one seeded permutation per epoch, epoch after epoch
(the same stream on every rank). Step ``s`` (from 1) trains on the stream's next ``global_batch``
indices, ``[(s - 1) * global_batch, s * global_batch)``, whatever the world size: where the job is
in its data is its step, which every rank restores. The world only splits each step's global batch
into consecutive shares, one per rank. When the world size does not divide the global batch, the
first ``global_batch % world`` ranks take one sample more, and each rank's loss is weighted by its
share (``weight``): the mean over ranks of the weighted per-rank mean losses is the mean over the
global batch, so the data-parallel all-reduce (``gradients_mean``) still averages the same samples.
An epoch that the global batch does not divide ends inside a step, whose global batch also holds
the first indices of the next epoch: no sample is dropped and none is seen twice.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Share:
    """One rank's part of one step's global batch: the data set's ``indices`` and the ``weight`` its
    per-rank mean loss takes (1.0 when the world size divides the global batch)."""

    step: int
    indices: np.ndarray
    weight: float


@dataclass(frozen=True)
class GlobalBatches:
    """The data stream of ``samples`` indices in global batches of ``global_batch`` (see the module
    docstring); ``shuffle`` False keeps every epoch in index order."""

    samples: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.samples < 1 or self.global_batch < 1:
            raise ValueError(f"GlobalBatches: samples ({self.samples}) and global_batch ({self.global_batch}) "
                             f"must be at least 1")

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The data set's indices in the order epoch ``epoch`` (from 0) visits them."""
        return _order(self.samples, self.seed, epoch, self.shuffle)

    def batch(self, step: int) -> np.ndarray:
        """Step ``step``'s global batch: the stream's indices ``[(step - 1) * global_batch, step * global_batch)``."""
        if step < 1:
            raise ValueError(f"GlobalBatches: steps count from 1, got {step}")
        start, stop = (step - 1) * self.global_batch, step * self.global_batch
        parts = []
        for epoch in range(start // self.samples, (stop - 1) // self.samples + 1):
            order = self.epoch_order(epoch)
            begin = max(start - epoch * self.samples, 0)
            parts.append(order[begin:min(stop - epoch * self.samples, self.samples)])
        return np.concatenate(parts)

    def share(self, step: int, rank: int, world: int) -> Share:
        """Rank ``rank``'s share of step ``step``'s global batch in a world of ``world`` ranks."""
        if not 0 <= rank < world:
            raise ValueError(f"GlobalBatches: rank {rank} is not in 0..{world - 1}")
        if world > self.global_batch:
            raise ValueError(f"GlobalBatches: a world of {world} ranks cannot split a global batch of "
                             f"{self.global_batch} samples (every rank needs one)")
        base, extra = divmod(self.global_batch, world)
        start = rank * base + min(rank, extra)
        size = base + (rank < extra)
        return Share(step, self.batch(step)[start:start + size], size * world / self.global_batch)

    def uneven(self, world: int) -> str:
        """The rule a world of ``world`` ranks trains by when it does not divide the global batch ("": it does)."""
        base, extra = divmod(self.global_batch, world)
        if not extra:
            return ""
        return (f"a global batch of {self.global_batch} over {world} ranks: ranks 0..{extra - 1} take {base + 1} "
                f"samples and the others {base}, each rank's loss weighted by its share (x{(base + 1) * world}/"
                f"{self.global_batch} and x{base * world}/{self.global_batch}), so the step averages the same "
                f"{self.global_batch} samples")


@functools.lru_cache(maxsize=4)
def _order(samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(samples) if shuffle else np.arange(samples)
    order.setflags(write=False)  # shared by every caller of the cache
    return order
