"""What mindft decides from the configuration beyond parsing: the backend, pre-flight checks, ATO data.

:mod:`mindft.config` only parses the environment; everything here may read a file or start
a process: which backend runs fault tolerance (:func:`choose_backend`), what ``mindft-launch``
and ``mindft config check`` refuse before anything starts (:func:`check_launchable`: the key
file, an importable mindio_ttp wheel), and the failure rate from MindSpore's ATO statistics.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from mindft.config import MINDX_TASK_VARIABLE, ConfigError, MindftConfig, TFTOptions
from mindft.net.keys import load_keys

log = logging.getLogger(__name__)

__all__ = ["MINDIO_IMPORT_TIMEOUT", "BackendChoice", "ato_failure_rate", "check_launchable", "choose_backend"]


def ato_failure_rate(tft: TFTOptions) -> float:
    """Faults per step from MindSpore's ATO statistics, or 0 when they do not apply.

    With ``ATO:1`` MindSpore 2.10 (earlier releases have no ATO) keeps ``{"failure_count",
    "total_steps"}`` in ``ATO_PATH`` (default ``./ato_info.json``) and, once ``failure_count`` reaches ``ATO_THRESHOLD``
    (default 10), advises the checkpoint interval sqrt(2 t_ckpt / (failure_rate t_step)).
    mindft reads the same file with the same rules; a missing or unreadable file gives 0.
    """
    if not tft.ato:
        return 0.0
    path = Path(tft.ato_path or "./ato_info.json")
    threshold = tft.ato_threshold if tft.ato_threshold is not None else 10
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        failures, steps = int(info.get("failure_count") or 0), int(info.get("total_steps") or 0)
    except FileNotFoundError:
        return 0.0
    except (OSError, ValueError, TypeError, AttributeError) as error:
        log.warning("ATO_PATH %s unreadable (%s): no failure rate for the snapshot cadence", path, error)
        return 0.0
    if failures < threshold or steps <= 0:
        log.info("ATO_PATH %s: %d failures in %d steps, below ATO_THRESHOLD=%d: not used", path, failures,
                 steps, threshold)
        return 0.0
    return failures / steps


@dataclass(frozen=True)
class BackendChoice:
    """Which backend runs fault tolerance, and why (``mindft config check`` prints both)."""

    backend: str
    reason: str


def choose_backend(config: MindftConfig, installed: bool, device: Callable[[], str],
                   environ: Mapping[str, str] = os.environ) -> BackendChoice:
    """The backend for ``config``: ``installed`` says whether mindio_ttp imports, ``device()`` is
    MindSpore's device target (asked only when it matters).

    ``auto`` picks mindio only where the wheel is installed *and* the job asks for MindIO: MindCluster
    runs MindIO's controller (``MINDX_TASK_ID`` set), or on Ascend ``MS_ENABLE_TFT`` holds an option
    that MindSpore itself runs on mindio_ttp (TTP, UCE, ARF, TSP, HCCE). Elsewhere (CPU) mindft
    implements those options itself; ``MINDFT_BACKEND=mindio`` runs them on MindIO there too.
    """
    if config.backend == "mindft":
        return BackendChoice("mindft", "MINDFT_BACKEND=mindft")
    if config.backend == "mindio":
        if not installed:
            raise ConfigError("MINDFT_BACKEND=mindio but the mindio_ttp package is not installed; "
                              "install the wheel (pip install mindio_ttp-*.whl) or set "
                              "MINDFT_BACKEND=mindft (or auto)")
        return BackendChoice("mindio", "MINDFT_BACKEND=mindio")
    if not installed:
        return BackendChoice("mindft", "MINDFT_BACKEND=auto and the mindio_ttp wheel is not installed")
    if environ.get(MINDX_TASK_VARIABLE, "").strip():
        return BackendChoice("mindio", f"MINDFT_BACKEND=auto, mindio_ttp installed and {MINDX_TASK_VARIABLE} "
                                       f"set (MindCluster runs MindIO's controller)")
    if config.tft.needs_mindio:
        target = device()
        if target == "Ascend":
            return BackendChoice("mindio", f"MINDFT_BACKEND=auto, mindio_ttp installed and MS_ENABLE_TFT="
                                           f"{config.tft} on Ascend (MindSpore runs these on mindio_ttp)")
        return BackendChoice("mindft", f"MINDFT_BACKEND=auto: mindio_ttp is installed but not asked for on "
                                       f"{target} (mindft implements MS_ENABLE_TFT={config.tft} itself); "
                                       f"set MINDFT_BACKEND=mindio to run it on MindIO TFT")
    return BackendChoice("mindft", f"MINDFT_BACKEND=auto: MS_ENABLE_TFT={config.tft} asks for nothing "
                                   f"MindIO runs (TTP, UCE, ARF, TSP, HCCE)")


MINDIO_IMPORT_TIMEOUT = 120.0  # importing mindio_ttp takes ~3 s; a hung import must not hang the check


def check_launchable(config: MindftConfig) -> None:
    """Refuse what ``mindft-launch`` would refuse beyond parsing (``mindft config check`` runs it too).

    With fault tolerance on: a key file that is missing, unreadable or readable by others;
    with ``MINDFT_BACKEND=mindio``: a mindio_ttp wheel that cannot be imported.
    """
    if config.tft.enabled and not config.insecure and config.key_file is not None:
        load_keys(config.key_file)
    if config.backend == "mindio":
        _check_mindio_importable()


def _check_mindio_importable() -> None:
    # In a child: the import needs MINDIO_FOR_MINDSPORE (else it imports torch) and leaves
    # native threads and exit-time logging behind in whoever imported it.
    env = dict(os.environ, MINDIO_FOR_MINDSPORE="true")
    try:
        result = subprocess.run([sys.executable, "-c", "import mindio_ttp.framework_ttp"], env=env,
                                capture_output=True, text=True, timeout=MINDIO_IMPORT_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"MINDFT_BACKEND=mindio: importing mindio_ttp did not finish in "
                          f"{MINDIO_IMPORT_TIMEOUT:g} s; set MINDFT_BACKEND=auto or mindft") from None
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        raise ConfigError(f"MINDFT_BACKEND=mindio but the mindio_ttp wheel cannot be imported "
                          f"({lines[-1] if lines else f'exit {result.returncode}'}); install it "
                          f"(pip install mindio_ttp-*.whl) or set MINDFT_BACKEND=auto or mindft")

