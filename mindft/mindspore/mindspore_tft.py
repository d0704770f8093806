"""MindSpore's own fault tolerance served by mindft: ``TrainFaultTolerance`` without MindIO.

MindSpore (2.7 to 2.10) runs ``MS_ENABLE_TFT='{TTP:1}'`` (and ``UCE``, ``ARF``, ``HCCE``) through its
``TrainFaultTolerance`` callback on MindIO TFT's ``mindio_ttp``, on Ascend only, and MindFormers'
Trainer appends that callback and wraps its optimizer for it. Under mindft's backend,
``mindft-launch`` starts such a script through this module (``python -m
mindft.mindspore.mindspore_tft SCRIPT ARGS``), which :func:`install` s three changes to MindSpore's
classes before the script's first line, so that the unmodified script runs on mindft:

* ``TrainFaultTolerance(...)`` keeps its arguments and starts nothing of MindIO's;
* ``TrainFaultTolerance.get_optimizer_wrapper(cls)`` returns ``cls`` itself: the wrapper's
  ``TensorReport`` has no CPU kernel, and the flag it all-reduces only tells MindIO that an update
  finished, which mindft knows from its step boundary;
* ``Model.train`` given such a callback runs as :func:`mindft.mindspore.train` with mindft's
  :class:`~mindft.mindspore.callback.FaultTolerance` in its place, which re-enters ``Model.train``
  after a rollback as MindSpore's ``_handle_tft`` does after MindIO's repair.

The last change also serves mindft's own callback handed to a ``Model.train`` the script does not
call itself (MindFormers' Trainer under ``RSC:1``, :mod:`mindft.mindformers`): ``Model.train`` then
re-enters itself after a rollback instead of raising :class:`~mindft.mindspore.RewindRequired`.
``_tft_handler.init`` (which MindFormers calls for ``ARF:1``) starts nothing either. Where the
backend is MindIO's (:func:`mindft.mindspore.backend.backend_choice`: ``MINDFT_BACKEND=mindio``, or
``auto`` on Ascend with the wheel installed), each change hands over to MindSpore's own code.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import runpy
import sys
from typing import Any, Callable, List, Optional

import mindspore
from mindspore.train import Model, TrainFaultTolerance
from mindspore.utils import _tft_handler

from mindft.config import ConfigError, MindftConfig, load_config
from mindft.exitcodes import ExitCode
from mindft.mindspore.backend import MINDIO, backend_choice

log = logging.getLogger(__name__)

# The MindSpore minor releases whose TrainFaultTolerance, Model.train and _tft_handler these
# changes were read from and tested against (CI: 2.7.2, 2.8.0, 2.9.0, 2.10.0; docs/compatibility.md).
TESTED_MINDSPORE = ("2.7", "2.8", "2.9", "2.10")
_ON_MINDFT = "_mindft_serves"  # set on a TrainFaultTolerance that mindft serves


def tested(version: str) -> bool:
    """True when MindSpore ``version`` is one of :data:`TESTED_MINDSPORE`."""
    return any(version == minor or version.startswith(minor + ".") for minor in TESTED_MINDSPORE)


def install(config: Optional[MindftConfig] = None) -> None:
    """Make MindSpore's ``TrainFaultTolerance`` run on mindft in this process, and ``Model.train``
    re-enter itself for it and for mindft's own callback (idempotent).

    Raises :class:`~mindft.config.ConfigError` on a MindSpore release outside
    :data:`TESTED_MINDSPORE`, or one whose internals these changes bind to differ (a patch
    release could): the changes rely on them.
    """
    if getattr(Model.train, _ON_MINDFT, False):
        return
    if not tested(mindspore.__version__):
        raise ConfigError(f"MS_ENABLE_TFT: mindft serves MindSpore's TrainFaultTolerance only on MindSpore "
                          f"{', '.join(m + '.x' for m in TESTED_MINDSPORE)}, this is {mindspore.__version__}; "
                          f"install mindspore=={TESTED_MINDSPORE[-1]}.* or use mindft.mindspore.train")
    changed = internals_changed()
    if changed:
        raise ConfigError(f"MS_ENABLE_TFT: mindft cannot serve MindSpore {mindspore.__version__}'s "
                          f"TrainFaultTolerance: {changed}, unlike every release it was tested with; "
                          f"use mindft.mindspore.train")
    config = config if config is not None else load_config()
    on_mindft = functools.partial(_on_mindft, config)
    TrainFaultTolerance.__init__ = _callback_init(TrainFaultTolerance.__init__, on_mindft)
    TrainFaultTolerance.get_optimizer_wrapper = _optimizer_wrapper(TrainFaultTolerance.get_optimizer_wrapper,
                                                                   on_mindft)
    _tft_handler.init = _handler_init(_tft_handler.init, on_mindft)
    Model.train = _model_train(Model.train, config)
    log.info("rank=%d MindSpore's TrainFaultTolerance runs on mindft (MS_ENABLE_TFT=%s)", config.rank, config.tft)


_MODEL_TRAIN = ("self", "epoch", "train_dataset", "callbacks", "dataset_sink_mode", "sink_size", "initial_epoch")


def internals_changed() -> str:
    """What of the internals :func:`install` replaces differs from the tested releases ("": nothing)."""
    train = tuple(inspect.signature(Model.train).parameters)
    if train != _MODEL_TRAIN:
        return f"Model.train takes {train}"
    init = inspect.signature(TrainFaultTolerance.__init__).parameters
    if "ckpt_save_path" not in init or not any(p.kind is p.VAR_KEYWORD for p in init.values()):
        return f"TrainFaultTolerance.__init__ takes {tuple(init)}"
    if not isinstance(inspect.getattr_static(TrainFaultTolerance, "get_optimizer_wrapper"), classmethod):
        return "TrainFaultTolerance.get_optimizer_wrapper is no classmethod"
    return ""


def _on_mindft(config: MindftConfig) -> bool:
    """True unless MindIO's controller runs this job (asked late: the script sets the device first)."""
    return backend_choice(config).backend != MINDIO


def _callback_init(original: Callable[..., None], on_mindft: Callable[[], bool]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: TrainFaultTolerance, ckpt_save_path: Optional[str] = None, **kwargs: Any) -> None:
        if not on_mindft():
            original(self, ckpt_save_path, **kwargs)
            return
        super(TrainFaultTolerance, self).__init__()  # Callback's: nothing of MindIO's
        if kwargs.get("ckpt_save_fn") is None and ckpt_save_path is None:
            raise ValueError("TrainFaultTolerance construct need to set ckpt_save_fn or ckpt_save_path!")
        self.ckpt_save_path = ckpt_save_path
        self.save_cb = kwargs.get("ckpt_save_fn")
        self.ckpt_load_func = kwargs.get("ckpt_load_fn")
        self.initial_step = int(kwargs.get("initial_step", 0))
        setattr(self, _ON_MINDFT, True)
    return __init__


def _optimizer_wrapper(original: Callable[[type], type], on_mindft: Callable[[], bool]) -> classmethod:
    wrap = original.__func__ if hasattr(original, "__func__") else original

    def get_optimizer_wrapper(cls: type, origin_opt_cls: type) -> type:
        return origin_opt_cls if on_mindft() else wrap(cls, origin_opt_cls)
    get_optimizer_wrapper.__doc__ = wrap.__doc__
    return classmethod(get_optimizer_wrapper)


def _handler_init(original: Callable[..., None], on_mindft: Callable[[], bool]) -> Callable[..., None]:
    @functools.wraps(original)
    def init(**kwargs: Any) -> None:
        if not on_mindft():
            original(**kwargs)
    return init


def _model_train(original: Callable[..., Any], config: MindftConfig) -> Callable[..., Any]:
    from mindft.mindspore.callback import FaultTolerance, train as mindft_train

    signature = inspect.signature(original)

    @functools.wraps(original)
    def train(self: Model, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        callbacks = as_callback_list(given["callbacks"])
        served = [cb for cb in callbacks if getattr(cb, _ON_MINDFT, False)]
        ours = next((cb for cb in callbacks if isinstance(cb, FaultTolerance)), None)
        if not served and (ours is None or ours.driven):
            return original(*bound.args, **bound.kwargs)
        kept = [cb for cb in callbacks if not any(cb is tft for tft in served)]
        if ours is None:
            kept.insert(0, FaultTolerance(config))
        return mindft_train(self, given["epoch"], given["train_dataset"], kept, given["dataset_sink_mode"],
                            given["sink_size"], given["initial_epoch"], config=config)
    setattr(train, _ON_MINDFT, True)
    return train


def as_callback_list(callbacks: Any) -> List[Any]:
    """``Model.train``'s ``callbacks`` argument (None, one callback or a sequence) as a list."""
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m mindft.mindspore.mindspore_tft SCRIPT ARGS``: :func:`install`, then run SCRIPT as
    ``python SCRIPT ARGS`` would."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m mindft.mindspore.mindspore_tft SCRIPT [ARGS...]")
    try:
        install()
    except ConfigError as error:
        print(f"mindft: {error}", file=sys.stderr)
        raise SystemExit(ExitCode.USAGE) from None
    script = args[0]
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
