"""``Model.train``'s dataset in an elastic job: :func:`elastic_dataset`.

Row ``i`` of the dataset (from 0, counted over every epoch) is this rank's share of step ``i + 1``
of a :class:`~mindft.rank.data.GlobalBatches` stream, already batched: the rank trains on the same
samples as the custom loop's :meth:`~mindft.mindspore.FaultTolerantLoop.shares`, so every sample is
used once whatever the world size. A ``Model.train`` epoch is ``samples // global_batch`` steps; the
stream carries the rest of the data set into the next epoch, so nothing is dropped.

A ``Model.train`` call starts its epochs from 0, whichever ``initial_epoch`` it was given: the
dataset's :class:`StepSampler` is told the first epoch by :func:`mindft.mindspore.train`, which
re-enters ``Model.train`` after every rollback, and so the dataset serves the steps only through it.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import mindspore.dataset as ds
import numpy as np

from mindft.config import MindftConfig, load_config
from mindft.rank.data import GlobalBatches

log = logging.getLogger(__name__)


class StepSampler(ds.Sampler):
    """Yields the step index (from 0) of each row: epoch ``first_epoch + k`` of a ``Model.train``
    call covers steps ``[e * steps_per_epoch, (e + 1) * steps_per_epoch)``. MindSpore copies the
    sampler into each iterator it builds and asks it once per epoch, in order, skipping rows of
    the first epoch by index (``set_init_step``) without reading them."""

    def __init__(self, steps_per_epoch: int) -> None:
        self.steps_per_epoch = steps_per_epoch
        self.first_epoch = 0  # set by mindft.mindspore.train before each Model.train call
        self._epochs = 0
        super().__init__()

    def __iter__(self) -> Iterator[int]:
        epoch = self.first_epoch + self._epochs
        self._epochs += 1
        return iter(range(epoch * self.steps_per_epoch, (epoch + 1) * self.steps_per_epoch))

    def __len__(self) -> int:
        return self.steps_per_epoch


class _Shares:
    """Random access to this rank's shares: item ``i`` is ``load(indices)`` of step ``i + 1``."""

    def __init__(self, data: GlobalBatches, load: Callable[[np.ndarray], Sequence[Any]], rank: int,
                 world: int, steps_per_epoch: int) -> None:
        self.data, self.load, self.rank, self.world = data, load, rank, world
        self.steps_per_epoch = steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __getitem__(self, index: int) -> Tuple[Any, ...]:
        return tuple(self.load(self.data.share(int(index) + 1, self.rank, self.world).indices))


def elastic_dataset(data: GlobalBatches, load: Callable[[np.ndarray], Sequence[Any]], column_names: Sequence[str],
                    config: Optional[MindftConfig] = None) -> ds.GeneratorDataset:
    """A dataset for :func:`mindft.mindspore.train` whose rows are this rank's shares of ``data``'s
    global batches, already batched (do not ``.batch()`` it; ``.map()`` is fine): ``load(indices)``
    returns the arrays of those samples, one per name in ``column_names``.

    ``Model.train`` cannot weight a rank's loss by its share: when the world size does not divide
    the global batch, the step averages the ranks' mean losses, and a sample of a smaller share
    weighs a little more (logged once; the custom loop's :meth:`~mindft.mindspore.FaultTolerantLoop.shares`
    weights it exactly). ``config`` defaults to :func:`mindft.config.load_config`.
    """
    config = config if config is not None else load_config()
    steps_per_epoch = data.samples // data.global_batch
    if not steps_per_epoch:
        raise ValueError(f"elastic_dataset: a global batch of {data.global_batch} is larger than the data set "
                         f"({data.samples} samples): a Model.train epoch would have no step")
    if data.uneven(config.world_size):
        base, extra = divmod(data.global_batch, config.world_size)
        log.warning("rank=%d a global batch of %d over %d ranks: ranks 0..%d take %d samples and the others %d; "
                    "Model.train averages the ranks' mean losses, so a sample weighs a little more on the smaller "
                    "shares (a global batch that every world size divides avoids it)", config.rank,
                    data.global_batch, config.world_size, extra - 1, base + 1, base)
    return ds.GeneratorDataset(_Shares(data, load, config.rank, config.world_size, steps_per_epoch),
                               list(column_names), sampler=StepSampler(steps_per_epoch), num_parallel_workers=1,
                               python_multiprocessing=False)


def step_sampler(dataset: Any) -> Optional[StepSampler]:
    """The :class:`StepSampler` at the root of ``dataset``'s pipeline (None: not an elastic dataset)."""
    while dataset is not None:
        sampler = getattr(dataset, "sampler", None)
        if isinstance(sampler, StepSampler):
            return sampler
        children = getattr(dataset, "children", None) or []
        dataset = children[0] if len(children) == 1 else None
    return None


def elastic_data_problem(dataset: Any, config: MindftConfig) -> str:
    """Why ``dataset`` cannot follow an elastic job's world size ("": it can, or the job is not
    elastic): only an :func:`elastic_dataset` serves each rank its share of the step's global batch."""
    if not config.elastic_min or step_sampler(dataset) is not None:
        return ""
    return (f"an elastic job (MINDFT_ELASTIC={config.elastic_min}:{config.elastic_max}) changes its world size, "
            f"and this dataset, sharded for one world size, cannot follow it: build it with "
            f"mindft.mindspore.elastic_dataset, or drop --nnodes MIN:MAX")
