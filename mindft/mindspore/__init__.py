"""mindft's MindSpore adapter — the only part of mindft that imports mindspore.

Two ways in:

* ``Model.train``: ``mindft.mindspore.train(model, epoch, train_dataset, ...)`` (or pass
  :class:`FaultTolerance` to ``Model.train`` yourself); in an elastic job its dataset from
  :func:`elastic_dataset`.
* hand-written loops: :class:`FaultTolerantLoop` (in an elastic job, each step's samples from
  :class:`GlobalBatches`).

Both do nothing but count steps unless ``MS_ENABLE_TFT`` enables an option.
"""
from __future__ import annotations

from mindft.rank.data import GlobalBatches, Share
from mindft.rank.faults import DeviceFault
from mindft.mindspore._session import EXIT_DUMPED, RewindRequired
from mindft.mindspore.callback import FaultTolerance, train
from mindft.mindspore.data import elastic_dataset
from mindft.mindspore.loop import FaultTolerantLoop

__all__ = ["DeviceFault", "EXIT_DUMPED", "FaultTolerance", "FaultTolerantLoop", "GlobalBatches", "RewindRequired",
           "Share", "elastic_dataset", "train"]
