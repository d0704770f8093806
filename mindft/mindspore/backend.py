"""Which implementation runs fault tolerance: mindft's own, or MindIO TTP where it is installed.

mindft never needs Huawei's proprietary ``mindio_ttp`` wheel. Where it is installed on an
Ascend machine and ``MS_ENABLE_TFT`` asks for options that MindSpore runs on it, the
``mindio`` backend hands the job to MindSpore's own ``TrainFaultTolerance`` callback
(and ``Model.train``'s built-in fault handling) behind the same one-line
:func:`mindft.mindspore.train`.
"""
from __future__ import annotations

import importlib.util
import logging

import mindspore as ms
from mindspore.train import Callback

from mindft.config import ConfigError, MindftConfig

log = logging.getLogger(__name__)

MINDFT = "mindft"
MINDIO = "mindio"


def mindio_installed() -> bool:
    """True when the ``mindio_ttp`` package can be imported."""
    return importlib.util.find_spec("mindio_ttp") is not None


def choose_backend(config: MindftConfig, installed: bool, device: str) -> str:
    """The backend for ``config`` given whether mindio-ttp is ``installed`` and the ``device`` target."""
    if config.backend == MINDFT:
        return MINDFT
    if config.backend == MINDIO:
        if not installed:
            raise ConfigError("MINDFT_BACKEND=mindio but the mindio_ttp package is not installed; "
                              "install Huawei's wheel (pip install $MINDIO_TTP_PKG) or set "
                              "MINDFT_BACKEND=mindft (or auto)")
        if device != "Ascend":
            raise ConfigError(f"MINDFT_BACKEND=mindio needs an Ascend device, MindSpore's device "
                              f"target is {device!r}; set MINDFT_BACKEND=mindft (or auto)")
        return MINDIO
    use_mindio = installed and device == "Ascend" and config.tft.needs_mindio
    return MINDIO if use_mindio else MINDFT


def resolve_backend(config: MindftConfig) -> str:
    """:func:`choose_backend` for this process, logged once per call."""
    backend = choose_backend(config, mindio_installed(), ms.get_context("device_target"))
    log.info("rank=%d fault-tolerance backend: %s (MINDFT_BACKEND=%s)", config.rank, backend, config.backend)
    return backend


def mindio_callback(config: MindftConfig) -> Callback:
    """MindSpore's own TTP callback, writing its dying-gasp checkpoints to ``config.dump_dir``."""
    from mindspore.train import TrainFaultTolerance  # only meaningful with mindio-ttp on Ascend

    return TrainFaultTolerance(ckpt_save_path=str(config.dump_dir))


def require_mindft_backend(config: MindftConfig, api: str) -> None:
    """Refuse ``api`` when the job runs on MindIO, which only drives ``Model.train``."""
    if config.tft.enabled and resolve_backend(config) == MINDIO:
        raise ConfigError(f"{api} runs on mindft's own backend, but MINDFT_BACKEND={config.backend} "
                          f"selects mindio-ttp here; use mindft.mindspore.train(model, ...) (which "
                          f"delegates to MindSpore's TrainFaultTolerance) or set MINDFT_BACKEND=mindft")
