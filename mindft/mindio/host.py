"""What node 0's launcher runs for a job on MindIO: MindIO's controller, the step gate, MindX's part."""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from mindft.flow.watcher import WatcherSupervision
from mindft.net.keys import CurveKeys
from mindft.mindio.controller import MindioController
from mindft.mindio.gate import StepGate
from mindft.mindio.standin import MindxStandIn
from mindft.mindio.wheel import MindioError
from mindft.device.watch import ResetWatcher

log = logging.getLogger(__name__)


class MindioHost:
    """What node 0's launcher runs for a job on MindIO: MindIO's controller, the step gate and MindX's part.

    ``port`` is MindIO's controller port (MS_TFT_PORT of the ranks); the gate listens on
    ``gate_port`` (0: a free one), :attr:`gate_endpoint`, given to the ranks as ``MINDFT_STEP_GATE``.
    MindIO's own TCP is neither authenticated nor encrypted; the gate uses the job's CurveZMQ key.
    With ``reset_file`` the device plugin's reset file is watched every ``poll_interval`` s and
    fed to the :class:`MindxStandIn` (``standin`` holds its ``kill``/``start``/``alive`` and
    timeouts), registered as MindIO's MindX.
    """

    def __init__(self, world_size: int, ip: str, port: int, keys: Optional[CurveKeys] = None,
                 gate_port: int = 0, reset_file: Optional[Any] = None, poll_interval: float = 1.0,
                 standin: Optional[Mapping[str, Any]] = None) -> None:
        self._controller_args = (world_size, ip, port)
        self._gate_args = (world_size, ip, keys, gate_port)
        self._standin_args = dict(standin or {})
        self._reset = (reset_file, poll_interval)
        self.gate: Optional[StepGate] = None
        self.standin: Optional[MindxStandIn] = None
        self.controller: Optional[MindioController] = None
        self.watcher: Optional[Any] = None
        self.supervision = WatcherSupervision(delay=0.0)  # a dead watcher restarts at once

    @property
    def gate_endpoint(self) -> str:
        """Where the ranks find the step gate (after :meth:`start`)."""
        if self.gate is None:
            raise MindioError("MindioHost not started")
        return self.gate.endpoint

    def start(self) -> None:
        """Start the gate, MindIO's controller with the MindX stand-in, then the reset watcher."""
        self.gate = StepGate(*self._gate_args, when_all_finished=self._destroy_controller_first)
        try:
            mindx = None
            if self._standin_args:
                self.standin = MindxStandIn(self.gate, **self._standin_args)
                mindx = self.standin.callbacks()
            self.controller = MindioController(*self._controller_args, mindx=mindx)
            self.controller.start()
            if self.standin is not None:
                self.standin.bind(self.controller.api)
                path, interval = self._reset
                if path is not None:
                    self.watcher = ResetWatcher(path, interval)
                    self.watcher.start(self.standin.on_device_event)
                    log.info("watching the device plugin's reset file %s every %gs (MindIO backend)", path,
                             interval)
        except Exception:
            self.stop()
            raise

    def _destroy_controller_first(self) -> None:
        """Every rank finished: destroy the controller before any rank destroys its processor.

        The controller's destroy first tells every processor it ends, which stops their reconnect;
        a processor destroyed while the controller lives can race its own reconnect and abort
        (see the quirks in :mod:`mindft.mindio.wheel`). MindSpore's rank 0 destroys the controller
        first for the same order.
        """
        controller = self.controller
        if controller is not None:
            log.info("every rank finished: destroying MindIO's controller before the ranks' processors")
            controller.stop()

    def check(self, now: float) -> Optional[str]:
        """Restart a reset watcher that died; the reason to fail the job once it died too often."""
        if self.watcher is None:
            return None
        return self.watcher.supervise(self.supervision, now, self.standin.on_device_event)

    def stop(self) -> None:
        """Stop all of it, bounded (idempotent)."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.standin is not None:
            self.standin.close()
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
