"""MindIO's controller, started where MindSpore would start it (rank 0 / node 0, not under MindCluster)."""
from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

from mindft.mindio.wheel import MindioError, bounded, import_wheel, set_environment, unregister_atexit

log = logging.getLogger(__name__)

MINDX_TASK_VARIABLE = "MINDX_TASK_ID"
# What MindIO's controller reports to MindCluster's MindX (clusterd) once all four are registered.
MINDX_ACTIONS = ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result")
# MINDIO_WAIT_MINDX_TIME: how long MindIO's controller waits for MindX. The stand-in answers at once
# (inside the callback), so the only wait that runs out is the one after a dump, where MindIO waits
# for MindX to stop the processes and, when MindX stays silent, orders them to exit itself.
MINDX_WAIT_SECONDS = "1"
# How long closing waits for the wheel's destroy of the controller: its teardown takes 3-7 s
# (its worker threads exit one by one).
CONTROLLER_CLOSE_TIMEOUT = 10.0


def controller_runs_here(rank: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process (rank or node ``rank``) starts MindIO's controller, as MindSpore decides."""
    return rank == 0 and not environ.get(MINDX_TASK_VARIABLE, "").strip()


class MindioController:
    """MindIO's controller, started in this process (rank 0 or node 0's launcher).

    Imports only ``mindio_ttp.controller_ttp``, so no framework is loaded. TLS is off: mindft
    runs MindIO on the job's private network (its own traffic stays CurveZMQ-secured).
    """

    def __init__(self, world_size: int, ip: str, port: int,
                 mindx: Optional[Mapping[str, Callable[..., Any]]] = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 1024 <= port <= 65535:
            raise ValueError(f"MindIO controller port must be in 1024..65535, got {port}")
        if mindx is not None and sorted(mindx) != sorted(MINDX_ACTIONS):
            raise ValueError(f"mindx must map exactly {', '.join(MINDX_ACTIONS)}; got {', '.join(sorted(mindx))}")
        self.world_size, self.ip, self.port = world_size, ip, port
        self._mindx = dict(mindx) if mindx is not None else None
        self._api: Optional[ModuleType] = None

    @property
    def api(self) -> ModuleType:
        """``mindio_ttp.controller_ttp`` once started (its ``tft_notify_controller_*`` calls)."""
        if self._api is None:
            raise MindioError("MindIO controller not started")
        return self._api

    def start(self) -> None:
        """Start listening on ``ip:port``; returns once the controller is up."""
        if self._api is not None:
            raise MindioError("MindIO controller already started")
        set_environment()
        api = import_wheel("mindio_ttp.controller_ttp")
        unregister_atexit(api.tft_destroy_controller)
        if self._mindx is not None:
            os.environ.setdefault("MINDIO_WAIT_MINDX_TIME", MINDX_WAIT_SECONDS)
            # Registered before init, as MindSpore's own stand-in does: the controller asks at
            # start whether all four are there, and only then consults MindX on every fault.
            for action, callback in self._mindx.items():
                if api.tft_register_mindx_callback(action, callback) != 0:
                    raise MindioError(f"MindIO refused the MindX callback {action!r}")
        api.tft_init_controller(0, self.world_size, False, enable_arf=self._mindx is not None)
        try:
            api.tft_start_controller(self.ip, self.port, False, "")
        except SystemExit:  # the wheel raises SystemExit(2) when the port is taken or invalid
            raise MindioError(f"MindIO controller could not start on {self.ip}:{self.port} "
                              f"(port in use? see MindIO's log above)") from None
        self._api = api
        log.info("MindIO controller listening on %s:%d for %d ranks", self.ip, self.port, self.world_size)

    def stop(self, timeout: float = CONTROLLER_CLOSE_TIMEOUT) -> bool:
        """Destroy the controller, waiting at most ``timeout`` s; True if it finished in time."""
        api, self._api = self._api, None
        if api is None:
            return True
        return bounded(api.tft_destroy_controller, timeout, "tft_destroy_controller")

    def __enter__(self) -> MindioController:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
