"""The MindSpore front of the rank engine under ``MINDFT_BACKEND=mindio``: MindIO decides, the snapshots do the work.

:class:`MindioSession` is a :class:`mindft.rank.engine.RankEngine` (the rank's store, capture,
restore, dump and exit) whose coordinator is MindIO's processor and the step gate
(:class:`mindft.mindio.loop.MindioLoop`, which says what a step and a recovery look like) instead
of mindft's controller; its state is the network's and the optimizer's Parameters
(:class:`~mindft.mindspore._session.TrainingState`) with MindSpore's global generator in every
snapshot. It has the front-end interface of :class:`mindft.mindspore._session.Session`, so
:class:`~mindft.mindspore.FaultTolerantLoop` and :func:`mindft.mindspore.train` run unchanged on it.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from mindspore import nn

from mindft.config import ConfigError, MindftConfig, load_config
from mindft.mindio.loop import MindioLoop
from mindft.mindspore._session import TrainingState, rng_meta, set_rng
from mindft.rank.engine import RankEngine


class MindioSession(RankEngine):
    """One rank's part in a MindIO-coordinated job; the same front-end interface as ``Session``.

    ``overlap`` is accepted for interface parity and ignored: MindIO must only hear of a step
    whose snapshot is complete, so every capture finishes before ``tft_end_updating_os``.
    ``snapshot_every`` must be 1 (MindIO may pick any completed step as the repair step): with
    this backend MINDFT_SNAPSHOT_EVERY unset means 1, not a budget.
    """

    def __init__(self, state: TrainingState, optimizer: Optional[nn.Cell],
                 config: Optional[MindftConfig] = None, overlap: Optional[bool] = None,
                 snapshot_every: Optional[int] = None) -> None:
        config = config if config is not None else load_config()
        every = snapshot_every if snapshot_every is not None else (config.snapshot_every or 1)
        if every != 1:
            raise ConfigError(f"MINDFT_SNAPSHOT_EVERY={every}: the mindio backend snapshots every step "
                              f"(MindIO may choose any completed step to repair); use 1 or "
                              f"MINDFT_BACKEND=mindft")
        super().__init__(state, config, 1)

    def join(self, restarted: bool, meta: Dict[str, Any], collectives: bool) -> None:
        """Join through MindIO (:meth:`mindft.mindio.loop.MindioLoop.start`); ``collectives`` is
        MindIO's to handle (its step gate keeps the ranks within one step)."""
        self.loop = loop = MindioLoop(self)
        loop.start(restarted, meta)

    def capture_meta(self) -> Dict[str, Any]:
        """MindSpore's global generator state goes with every snapshot."""
        return rng_meta()

    def restored_meta(self, meta: Mapping[str, Any]) -> None:
        """Put the generator state of the restored snapshot back."""
        set_rng(meta)
