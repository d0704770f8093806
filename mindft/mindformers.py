"""MindFormers' Trainer protected by mindft's own callback (``MS_ENABLE_TFT='{RSC:1}'``).

``import mindft.mindformers`` registers :class:`~mindft.mindspore.FaultTolerance` in MindFormers'
registry as :data:`CALLBACK_NAME`, so a yaml ``callbacks:`` list can name it, and makes
``Model.train`` re-enter itself after a rollback when it holds that callback (the Trainer owns
``Model.train``; see :mod:`mindft.mindspore.mindspore_tft`). :func:`train` does both for a Trainer
built in code. With ``MS_ENABLE_TFT='{TTP:1}'`` none of this is needed: ``mindft-launch`` serves
the ``TrainFaultTolerance`` callback MindFormers appends itself.

In an elastic job (``mindft-launch --nnodes MIN:MAX``) a pure data-parallel config (``parallel_mode:
0``, where MindFormers takes ``data_parallel`` from the world size) follows the world size when the
Trainer trains on :func:`mindft.mindspore.elastic_dataset`; :func:`train` refuses anything else
before the Trainer builds its model (:func:`elastic_problem`).
"""
from __future__ import annotations

import logging
from typing import Any

import mindspore as ms
from mindformers.core.context.build_context import Context, build_context
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

from mindft.config import MindftConfig, load_config
from mindft.flow.elastic import parallel_refusal
from mindft.mindspore.callback import FaultTolerance
from mindft.mindspore.data import elastic_data_problem
from mindft.mindspore.mindspore_tft import as_callback_list, install

log = logging.getLogger(__name__)

__all__ = ["CALLBACK_NAME", "elastic_problem", "train"]

CALLBACK_NAME = "MindftFaultTolerance"  # ``- type: MindftFaultTolerance`` in a yaml's callbacks
# MindFormers' ``parallel.parallel_mode`` numbers, by MindSpore's names.
_PARALLEL_MODES = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel", 3: "hybrid_parallel"}
_MODES = {"0": ms.GRAPH_MODE, "GRAPH_MODE": ms.GRAPH_MODE, "1": ms.PYNATIVE_MODE, "PYNATIVE_MODE": ms.PYNATIVE_MODE}


def _register() -> None:
    if not MindFormerRegister.is_exist(MindFormerModuleType.CALLBACK, CALLBACK_NAME):
        MindFormerRegister.register_cls(FaultTolerance, module_type=MindFormerModuleType.CALLBACK,
                                        alias=CALLBACK_NAME)


def train(trainer: Any, **train_kwargs: Any) -> Any:
    """``trainer.train(**train_kwargs)`` protected by mindft: adds :class:`FaultTolerance` to the
    Trainer's callbacks unless its config already names :data:`CALLBACK_NAME`, and builds
    MindFormers' context from the Trainer's config first when nothing built it yet (otherwise the
    Trainer builds it from an empty config, in PyNative mode, whatever the config asks for)."""
    install()
    config = trainer.config
    problem = elastic_problem(config, train_kwargs.get("train_dataset", trainer.train_dataset), load_config())
    if problem:
        raise ValueError(f"mindft.mindformers.train: {problem}")
    if not Context.is_exists():
        build_context(config)
    named = any(_type_of(entry) == CALLBACK_NAME for entry in (config.get("callbacks") or []))
    given = as_callback_list(trainer.callbacks)
    if not named and not any(isinstance(cb, FaultTolerance) for cb in given):
        trainer.callbacks = [*given, FaultTolerance()]
    result = trainer.train(**train_kwargs)
    _warn_on_mode_change(config)
    return result


def elastic_problem(trainer_config: Any, train_dataset: Any, config: MindftConfig) -> str:
    """Why a Trainer of ``trainer_config`` training on ``train_dataset`` cannot be in an elastic job
    ("": it can, or the job is not elastic): the config's parallel mode or sharded optimizer
    (:func:`mindft.flow.elastic.parallel_refusal`), or a dataset sharded for one world size
    (MindFormers' own from the config, or any but an elastic_dataset)."""
    if not config.elastic_min:
        return ""
    parallel = trainer_config.get("parallel") or {}
    mode = parallel.get("parallel_mode", 0)
    refusal = parallel_refusal(config, _PARALLEL_MODES.get(mode, str(mode).lower()),
                               bool(parallel.get("enable_parallel_optimizer", False)))
    if refusal:
        return f"{refusal} (the Trainer's parallel: section; a pure data-parallel config has parallel_mode: 0)"
    return elastic_data_problem(train_dataset, config)


def _warn_on_mode_change(config: Any) -> None:
    wanted = _MODES.get(str((config.get("context") or {}).get("mode")))
    if wanted is not None and wanted != ms.get_context("mode"):
        log.warning("MindFormers ran in mode %s, not the mode %s its config asks for: build its context "
                    "(mindformers.build_context(config)) before creating the Trainer", ms.get_context("mode"),
                    wanted)


def _type_of(entry: Any) -> Any:
    return entry.get("type") if hasattr(entry, "get") else None


_register()
install()
