"""Fault tolerance for hand-written training loops: :class:`FaultTolerantLoop`."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional, Tuple

from mindspore import nn

from mindft.config import MindftConfig, load_config
from mindft.mindspore._session import TrainingState
from mindft.mindspore.backend import session_class
from mindft.rank.data import GlobalBatches, Share

log = logging.getLogger(__name__)


class FaultTolerantLoop:
    """Guard a custom loop: snapshot every step, report progress, and replay after a rollback.

    ::

        with FaultTolerantLoop(net, optimizer) as loop:
            for step, batch in loop.batches(make_batch, total_steps):
                loop.step(train_step, *batch)

    ``make_batch(step)`` must return the batch of ``step`` (1-based) deterministically:
    after a rollback to step ``k``, :meth:`batches` continues with ``make_batch(k + 1)``.
    An exception inside :meth:`step` is classified and reported, and the loop waits for
    the controller instead of crashing. With ``MS_ENABLE_TFT`` unset the guard only counts steps.
    ``config`` defaults to :func:`mindft.config.load_config`; ``overlap`` and
    ``snapshot_every`` are described in :class:`mindft.mindspore._session.Session` (pass
    ``overlap=False`` if the whole step, optimizer included, is one compiled graph Cell).

    An elastic job (``mindft-launch --nnodes MIN:MAX``) changes its world size between steps: iterate
    :meth:`shares` instead of :meth:`batches`, which it refuses, so that every sample is used once.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Cell, config: Optional[MindftConfig] = None,
                 overlap: Optional[bool] = None, snapshot_every: Optional[int] = None) -> None:
        config = config if config is not None else load_config()
        self.session = session_class(config)(TrainingState(network, optimizer), optimizer, config, overlap,
                                             snapshot_every)
        self._finished = False

    @property
    def position(self) -> int:
        """Steps completed so far; the next step is ``position + 1``."""
        return self.session.step

    def __enter__(self) -> FaultTolerantLoop:
        self.session.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None and not self._finished:
            # The loop was left without batches(): wait for the other ranks here.
            if self.session.finish() is not None:
                raise RuntimeError("a rank faulted after this one left its loop: iterate with batches() "
                                   "so the loop can replay the steps rolled back")
        self.session.close()

    def batches(self, make_batch: Callable[[int], Any], steps: int) -> Iterator[Tuple[int, Any]]:
        """Yield ``(step, make_batch(step))`` until ``steps`` steps are done on every rank, following rollbacks."""
        config = self.session.config
        if config.elastic_min:
            raise ValueError(f"FaultTolerantLoop.batches: an elastic job (MINDFT_ELASTIC={config.elastic_min}:"
                             f"{config.elastic_max}) changes its world size, and make_batch(step) cannot follow it: "
                             f"iterate loop.shares(GlobalBatches(samples, global_batch, seed), steps) and build "
                             f"each step's batch from share.indices")
        return self._steps(make_batch, steps)

    def shares(self, data: GlobalBatches, steps: int, start: int = 0) -> Iterator[Tuple[int, Share]]:
        """Yield ``(step, share)``, this rank's :class:`~mindft.rank.data.Share` of each step's global
        batch, until ``steps`` steps are done on every rank, following rollbacks and, in an elastic
        job, the world size (:mod:`mindft.rank.data`: every sample of every epoch used once).
        ``start``: the steps trained before this job (a resume): its first step is the data's ``start + 1``."""
        config = self.session.config
        rule = data.uneven(config.world_size)
        if rule:
            log.warning("rank=%d %s", config.rank, rule)
        for step, share in self._steps(lambda step: data.share(start + step, config.rank, config.world_size), steps):
            yield start + step, share

    def _steps(self, make_batch: Callable[[int], Any], steps: int) -> Iterator[Tuple[int, Any]]:
        while True:
            while self.session.step < steps:
                step = self.session.step + 1
                yield step, make_batch(step)
            if self.session.finish() is None:  # None: every rank is done; else a late fault rolled back
                self._finished = True
                return

    def step(self, train_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``train_step(*args, **kwargs)`` as the next step; its result, or None if it faulted."""
        session = self.session
        try:
            session.begin_step()
            result = train_step(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - classified and reported, or re-raised
            session.fault(error)
            return None
        session.end_step()
        return result
