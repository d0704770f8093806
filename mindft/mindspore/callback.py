"""``Model.train`` integration: the :class:`FaultTolerance` callback and the re-entrant :func:`train`."""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable, List, Optional

from mindspore import context
from mindspore.train import Callback, Model

from mindft.config import MindftConfig, load_config
from mindft.exitcodes import ExitCode
from mindft.mindspore.backend import delegates_to_mindspore, mindio_callback, session_class
from mindft.mindspore.data import StepSampler, elastic_data_problem, step_sampler
from mindft.mindspore._session import RewindRequired, Session, TrainingState, optimizer_of

log = logging.getLogger(__name__)


class FaultTolerance(Callback):
    """Snapshot every step, report progress, and obey PAUSE / ROLLBACK / RESUME / DUMP_AND_EXIT.

    Pass it to :func:`train` (which also replays from a rolled-back step), or to
    ``Model.train`` directly: pauses and rollbacks to the current step then work as
    well, but a rollback to an earlier step raises :class:`RewindRequired` out of
    ``Model.train``. With ``MS_ENABLE_TFT`` unset it logs one line and does nothing.
    ``config`` defaults to :func:`mindft.config.load_config`; ``snapshot_every=N`` snapshots
    every N-th step only (the same N on every rank; a fault replays up to N steps).
    """

    def __init__(self, config: Optional[MindftConfig] = None, snapshot_every: Optional[int] = None) -> None:
        super().__init__()
        self._config = config
        self._snapshot_every = snapshot_every
        self.session: Optional[Session] = None
        self.steps_per_epoch = 0
        self._driven = False  # True when train() owns the session's start and finish

    @property
    def driven(self) -> bool:
        """True while :func:`train` drives this callback (and re-enters ``Model.train`` itself)."""
        return self._driven

    def attach(self, train_network: Any, optimizer: Any = None, steps_per_epoch: int = 0) -> int:
        """Start protecting ``train_network`` (idempotent); returns the step training continues after."""
        if self.session is None:
            self._config = self._config if self._config is not None else load_config()
            if self._config.elastic_min and not self._driven:
                raise ValueError(f"mindft: an elastic job (MINDFT_ELASTIC={self._config.elastic_min}:"
                                 f"{self._config.elastic_max}) changes its world size, which only "
                                 f"mindft.mindspore.train can follow (with an elastic_dataset): call it instead of "
                                 f"Model.train")
            optimizer = optimizer if optimizer is not None else optimizer_of(train_network)
            self.session = session_class(self._config)(TrainingState(train_network, optimizer), optimizer,
                                                       self._config, snapshot_every=self._snapshot_every)
            self.steps_per_epoch = steps_per_epoch
            self.session.start(self._position(0))
            if not self._driven:
                self._exit_on_uncaught_rewind()
        return self.session.step

    def _exit_on_uncaught_rewind(self) -> None:
        """A :class:`RewindRequired` that the script does not catch ends the process with one line
        and its own exit code (:attr:`~mindft.exitcodes.ExitCode.REWIND_REQUIRED`), which the launcher
        does not restart: a new process would restore the same step and raise it again."""
        previous = sys.excepthook

        def hook(kind: type, error: BaseException, trace: Any) -> None:
            if not isinstance(error, RewindRequired):
                previous(kind, error, trace)
                return
            rank = self.session.config.rank if self.session is not None else -1
            sys.stderr.write(f"mindft: rank {rank}: {error}\n")
            sys.stderr.flush()
            sys.stdout.flush()
            if self.session is not None:
                self.session.close()
            os._exit(ExitCode.REWIND_REQUIRED)  # no interpreter teardown: its exit code is the message

        sys.excepthook = hook

    def on_train_begin(self, run_context: Any) -> None:
        """Register with the controller (first call only); a restarted rank restores its state here."""
        args = run_context.original_args()
        if self._driven:
            # Re-entered after a rollback: the callbacks' step count goes on from the restored step
            # (MindFormers' checkpoints record it), not from 0 as a new Model.train call would.
            args.cur_step_num = self.session.step
        if self.session is None:
            self.attach(args.train_network, getattr(args, "optimizer", None), int(args.batch_num))
            if self.session.step:
                raise RewindRequired(self.session.step)

    def on_train_step_begin(self, run_context: Any) -> None:
        """Raise an injected fault armed by the controller."""
        self.session.begin_step()

    def on_train_step_end(self, run_context: Any) -> None:
        """Snapshot, report the step, obey a pending action."""
        rewound = self.session.end_step(self._position(self.session.step + 1))
        if rewound is not None:
            raise RewindRequired(rewound)

    def on_train_end(self, run_context: Any) -> None:
        """Report Done and wait for every rank (unless :func:`train` is driving and may re-enter)."""
        if not self._driven and self.session is not None:
            rewound = self.session.finish()
            if rewound is not None:
                raise RewindRequired(rewound)
            self.session.close()

    def _position(self, step: int) -> dict:
        if not self.steps_per_epoch:
            return {"step": step}
        epoch, batch = divmod(step, self.steps_per_epoch)
        return {"step": step, "epoch": epoch, "batch_in_epoch": batch}


def train(model: Model, epoch: int, train_dataset: Any, callbacks: Optional[Iterable[Callback]] = None,
          dataset_sink_mode: bool = False, sink_size: int = -1, initial_epoch: int = 0, *,
          config: Optional[MindftConfig] = None, snapshot_every: Optional[int] = None) -> int:
    """``model.train(...)`` that survives faults, with ``Model.train``'s parameters; returns the
    steps trained.

    After a rollback to step ``k`` it re-enters ``Model.train`` at the epoch and batch after
    step ``k`` (the first batches of that epoch skipped), so training goes on exactly where it
    was. The dataset must yield the same batches in the same order every epoch (a
    deterministic order, e.g. ``shuffle=False`` or a seeded per-epoch shuffle).
    ``initial_epoch`` starts at that epoch, as ``Model.train`` does (the steps count from there).
    ``dataset_sink_mode`` is honoured where ``Model.train`` does not sink anyway (CPU,
    PyNative); a sinking device runs ``sink_size`` steps per call, between mindft's step
    boundaries, so there it is refused before training starts, with what to change.
    ``config`` and ``snapshot_every`` go to the :class:`FaultTolerance` callback this adds
    (unless ``callbacks`` already holds one).
    """
    problem = sink_problem(dataset_sink_mode, sink_size, context.get_context("device_target"),
                           context.get_context("mode") == context.PYNATIVE_MODE)
    if problem:
        raise ValueError(f"mindft.mindspore.train: {problem}")
    if not 0 <= initial_epoch < epoch:
        raise ValueError(f"mindft.mindspore.train: initial_epoch must be in 0..{epoch - 1} (epoch={epoch}), "
                         f"got {initial_epoch}")
    cbs: List[Callback] = list(callbacks or [])
    config = config if config is not None else load_config()
    if delegates_to_mindspore(config):
        # On Ascend MindSpore's Model.train retries in place with mindio-ttp (_handle_tft): no re-entry here.
        model.train(epoch, train_dataset, callbacks=[*cbs, mindio_callback(config)], dataset_sink_mode=False,
                    initial_epoch=initial_epoch)
        return (epoch - initial_epoch) * train_dataset.get_dataset_size()
    ft = next((cb for cb in cbs if isinstance(cb, FaultTolerance)), None)
    if ft is None:
        ft = FaultTolerance(config, snapshot_every)
        cbs.insert(0, ft)
    problem = elastic_data_problem(train_dataset, config)
    if problem:
        raise ValueError(f"mindft.mindspore.train: {problem}")
    sampler = step_sampler(train_dataset)
    per_epoch = train_dataset.get_dataset_size()
    # Batches the dataset already skips in its first epoch (set_init_step: MindFormers' resume does).
    skipped = train_dataset.get_init_step() % per_epoch
    total = (epoch - initial_epoch) * per_epoch - skipped
    ft._driven = True
    ft.attach(model.train_network, getattr(model, "_optimizer", None), per_epoch)
    session = ft.session
    try:
        while True:
            _train_to(model, epoch, initial_epoch, train_dataset, cbs, session, per_epoch, total, skipped, sampler)
            if session.finish() is None:  # None: every rank is done; else a late fault rolled back
                break
    finally:
        session.close()
    return session.step


def sink_problem(sink_mode: bool, sink_size: int, device: str, pynative: bool) -> str:
    """Why ``dataset_sink_mode``/``sink_size`` cannot be protected step by step ("": they can)."""
    if not sink_mode or device == "CPU" or pynative:
        return ""  # Model.train does not sink here: every step ends in the callbacks
    return (f"dataset_sink_mode=True on {device} runs {'a whole epoch' if sink_size == -1 else f'{sink_size} steps'}"
            f" per call (sink_size={sink_size}), with no step boundary for mindft to snapshot or roll back at: "
            f"pass dataset_sink_mode=False")


def _train_to(model: Model, epoch: int, first_epoch: int, dataset: Any, cbs: List[Callback], session: Session,
              per_epoch: int, total: int, skipped: int, sampler: Optional[StepSampler]) -> None:
    """Run Model.train until ``total`` steps after batch ``skipped`` of epoch ``first_epoch``,
    re-entering it after every rollback."""
    while session.step < total:
        done, offset = divmod(skipped + session.step, per_epoch)
        try:
            # One call from the batch after the rolled-back step to the end, as MindSpore's own
            # _handle_tft re-enters: the interrupted epoch starts at batch offset + 1 (set_init_step
            # applies to the first epoch of the call), so callbacks see one train begin and end.
            dataset.set_init_step(offset)
            if sampler is not None:
                sampler.first_epoch = first_epoch + done  # Model.train counts this call's epochs from 0
            model.train(epoch, dataset, callbacks=cbs, dataset_sink_mode=False, initial_epoch=first_epoch + done)
            break  # finished, or stopped on request: either way not to be re-entered
        except RewindRequired as rewind:
            log.info("re-entering Model.train after step %d", rewind.step)
        except Exception as error:  # noqa: BLE001 - classified and reported, or re-raised
            session.fault(error)
        finally:
            dataset.set_init_step(0)
