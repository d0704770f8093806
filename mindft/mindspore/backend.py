"""Which implementation coordinates fault tolerance: mindft's own controller, or MindIO TFT's.

With the ``mindio`` backend MindIO TFT (the ``mindio_ttp`` wheel) decides when ranks stop and
which step they resume from, and mindft's snapshots do the work inside its handlers
(:class:`mindft.mindspore._mindio_session.MindioSession`) behind the same front ends. On an Ascend
device :func:`mindft.mindspore.train` instead hands ``Model.train`` to MindSpore's own
``TrainFaultTolerance`` (which refuses any other device; untested here). The choice itself is
:func:`mindft.preflight.choose_backend`.
"""
from __future__ import annotations

import importlib.util
import logging

import mindspore as ms
from mindspore.train import Callback

from mindft.config import MindftConfig
from mindft.preflight import BackendChoice, choose_backend

log = logging.getLogger(__name__)

MINDFT = "mindft"
MINDIO = "mindio"


def mindio_installed() -> bool:
    """True when the ``mindio_ttp`` package can be found."""
    return importlib.util.find_spec("mindio_ttp") is not None


def device_target() -> str:
    """MindSpore's device target in this process."""
    return str(ms.get_context("device_target"))


def backend_choice(config: MindftConfig) -> BackendChoice:
    """:func:`mindft.preflight.choose_backend` for this process."""
    return choose_backend(config, mindio_installed(), device_target)


def resolve_backend(config: MindftConfig) -> str:
    """The backend this process runs, logged."""
    choice = backend_choice(config)
    log.info("rank=%d fault-tolerance backend: %s (%s)", config.rank, choice.backend, choice.reason)
    return choice.backend


def session_class(config: MindftConfig) -> type:
    """The per-rank engine for ``config``: ``Session`` (mindft) or ``MindioSession`` (mindio)."""
    if config.tft.enabled and resolve_backend(config) == MINDIO:
        from mindft.mindspore._mindio_session import MindioSession

        return MindioSession
    from mindft.mindspore._session import Session

    return Session


def delegates_to_mindspore(config: MindftConfig) -> bool:
    """True where ``train`` hands ``Model.train`` to MindSpore's TrainFaultTolerance (mindio on Ascend)."""
    return config.tft.enabled and device_target() == "Ascend" and resolve_backend(config) == MINDIO


def mindio_callback(config: MindftConfig) -> Callback:
    """MindSpore's own TTP callback, writing its dying-gasp checkpoints to ``config.dump_dir``."""
    from mindspore.train import TrainFaultTolerance  # Ascend only

    return TrainFaultTolerance(ckpt_save_path=str(config.dump_dir))
