"""``Model.train`` integration: the :class:`FaultTolerance` callback and the re-entrant :func:`train`."""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable, List, Optional

from mindspore.train import Callback, Model

from mindft.config import MindftConfig, load_config
from mindft.exitcodes import ExitCode
from mindft.mindspore.backend import delegates_to_mindspore, mindio_callback, session_class
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

    def attach(self, train_network: Any, optimizer: Any = None, steps_per_epoch: int = 0) -> int:
        """Start protecting ``train_network`` (idempotent); returns the step training continues after."""
        if self.session is None:
            self._config = self._config if self._config is not None else load_config()
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


def train(model: Model, epochs: int, dataset: Any, callbacks: Optional[Iterable[Callback]] = None,
          config: Optional[MindftConfig] = None, snapshot_every: Optional[int] = None) -> int:
    """``model.train(epochs, dataset, callbacks)`` that survives faults; returns the final step.

    Runs with ``dataset_sink_mode=False``. After a rollback to step ``k`` it re-enters
    ``Model.train`` at epoch ``k // steps_per_epoch`` with the first
    ``k % steps_per_epoch`` batches of that epoch skipped, so the next batch is batch
    ``k + 1``. The dataset must yield the same batches in the same order every epoch
    (deterministic order, e.g. ``shuffle=False`` or a seeded per-epoch shuffle).
    ``config`` and ``snapshot_every`` go to the :class:`FaultTolerance` callback this adds
    (unless ``callbacks`` already holds one).
    """
    cbs: List[Callback] = list(callbacks or [])
    config = config if config is not None else load_config()
    if delegates_to_mindspore(config):
        # On Ascend MindSpore's Model.train retries in place with mindio-ttp (_handle_tft): no re-entry here.
        model.train(epochs, dataset, callbacks=[*cbs, mindio_callback(config)], dataset_sink_mode=False)
        return epochs * dataset.get_dataset_size()
    ft = next((cb for cb in cbs if isinstance(cb, FaultTolerance)), None)
    if ft is None:
        ft = FaultTolerance(config, snapshot_every)
        cbs.insert(0, ft)
    per_epoch = dataset.get_dataset_size()
    total = epochs * per_epoch
    ft._driven = True
    ft.attach(model.train_network, getattr(model, "_optimizer", None), per_epoch)
    session = ft.session
    try:
        while True:
            _train_to(model, epochs, dataset, cbs, session, per_epoch, total)
            if session.finish() is None:  # None: every rank is done; else a late fault rolled back
                break
    finally:
        session.close()
    return session.step


def _train_to(model: Model, epochs: int, dataset: Any, cbs: List[Callback], session: Session, per_epoch: int,
              total: int) -> None:
    """Run Model.train until ``total`` steps, re-entering it after every rollback."""
    while session.step < total:
        epoch, offset = divmod(session.step, per_epoch)
        try:
            if offset:
                # Finish the interrupted epoch from batch offset + 1, then go on normally.
                model.train(epoch + 1, dataset.skip(offset), callbacks=cbs, dataset_sink_mode=False,
                            initial_epoch=epoch)
                if session.step < (epoch + 1) * per_epoch:
                    break  # a callback asked Model.train to stop
            else:
                model.train(epochs, dataset, callbacks=cbs, dataset_sink_mode=False, initial_epoch=epoch)
                break  # finished, or stopped on request: either way not to be re-entered
        except RewindRequired as rewind:
            log.info("re-entering Model.train after step %d", rewind.step)
        except Exception as error:  # noqa: BLE001 - classified and reported, or re-raised
            session.fault(error)
