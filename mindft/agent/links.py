"""How a node agent reaches the job's controller: on node 0 the controller runs in the agent's
process (:class:`ControllerHost`, with the reset-file watcher), elsewhere the agent holds a
ZeroMQ link of its own to it (:class:`ControllerLink`)."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional

import zmq

from mindft.net import channel
from mindft.config import ConfigError, MindftConfig, load_config
from mindft.exitcodes import ExitCode
from mindft.flow.watcher import WatcherSupervision
from mindft.flow.effects import Finish
from mindft.flow.episode import PHASE_TIMEOUTS
from mindft.agent.plan import LaunchSpec
from mindft.protocol import JobState, Message, ProtocolError, StatusReply, decode, encode

log = logging.getLogger(__name__)

def recovery_progress(status: StatusReply, seconds_in_state: float) -> Optional[str]:
    """One progress line while a recovery waits (state, who is waited on, time left); None otherwise."""
    name = PHASE_TIMEOUTS.get(status.state)
    if name is None or status.state is JobState.STARTING:
        return None
    who = f"waiting for {status.waiting}" if status.waiting else "waiting"
    left = f"; {status.deadline_in:.0f}s left (timeouts.{name})" if status.deadline_in >= 0 else ""
    faults = f"; faults: {status.reason}" if status.reason else ""
    # Numbered as "recovery N done in ..." numbers them: the recoveries so far, this one included.
    return f"recovery {status.recoveries + 1}: {status.state} for {seconds_in_state:.0f}s, {who}{left}{faults}"


class ControllerHost:
    """The controller and the reset watcher, in threads of node 0's agent.

    A thread that dies is noticed here: the watcher is restarted as :class:`WatcherSupervision`
    says; a dead controller fails the job.
    """

    def __init__(self, config: MindftConfig, controller_class: Optional[type] = None,
                 metrics_at: Optional[tuple[str, int]] = None, run_dir: Optional[Path] = None,
                 node_metrics: Optional[Any] = None, node: int = 0, standby_term: Optional[int] = None,
                 supersedes: str = "") -> None:
        from mindft.controller import Controller  # imported late: only node 0 needs it
        from mindft.observe.metrics import JobMetrics, MetricsServer
        from mindft.device.watch import ResetWatcher

        self.config = config
        metrics = JobMetrics()
        if node_metrics is not None:  # node 0's own (mindft.observe.metrics.NodeCollector), on the same port
            metrics.registry.register(node_metrics)
        # ``metrics_at`` (address, port): the controller's metrics served over HTTP, bound before the
        # controller so that a taken port leaves nothing to close.
        self.metrics_server: Optional[MetricsServer] = None
        if metrics_at is not None:
            address, port = metrics_at
            self.metrics_server = MetricsServer(metrics.registry, address, port, run_dir)
        try:
            # Binds now: port 0 becomes a real port.
            self.controller = (controller_class or Controller)(config, metrics=metrics, node=node,
                                                               standby_term=standby_term, supersedes=supersedes)
        except zmq.ZMQError as error:
            self.close_metrics()
            if error.errno != zmq.EADDRINUSE:
                raise
            # Taken since the launcher's check: a configuration error (exit 2), not a traceback.
            raise ConfigError(f"port {config.controller_port} on {config.controller_ip}, the controller's "
                              f"port, is in use; choose another --master-port (or MS_TFT_PORT)") from None
        except BaseException:
            self.close_metrics()
            raise
        if self.metrics_server is not None:
            self.metrics_server.show(self.controller.latest_status)
        self.port = int(self.controller.endpoint.rsplit(":", 1)[1])
        self.result: Optional[Any] = None
        self.watcher = ResetWatcher(config.reset_file, config.timeouts.reset_poll_interval)
        self.supervision = WatcherSupervision()
        self.watching = False
        self._controller_thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._controller_thread = self.controller.start()

    def status(self) -> StatusReply:
        return self.controller.latest_status()

    def poll(self) -> Optional[Any]:
        """The controller's result once it finished; a controller thread that died counts as a failure."""
        if self.result is None and self._controller_thread is not None:
            result = self.controller.join(0)
            if result is not None:
                self.result = result
            elif not self._controller_thread.is_alive():
                log.error("the controller thread died without a result (its traceback is above); failing the job")
                self.result = Finish(ExitCode.FAILED, "the controller thread died")
        return self.result

    def start_watcher_when_training(self, state: Optional[JobState]) -> None:
        """Start the reset watcher once every rank registered: the controller ignores device events
        for ranks it does not know yet, so a fault already in the file is read when it can be acted on."""
        if self.watching or state in (None, JobState.STARTING) or self.poll() is not None:
            return
        self.watching = True
        self.watcher.start(self.controller.on_device_event)  # the watcher speaks the flow's inputs
        log.info("watching the device plugin's reset file %s every %gs", self.config.reset_file,
                 self.config.timeouts.reset_poll_interval)

    def check_watcher(self, now: float) -> Optional[str]:
        """Restart a watcher thread that died; the reason to fail the job once it died too often."""
        return self.watcher.supervise(self.supervision, now, self.controller.on_device_event)

    def stop(self) -> None:
        self.watcher.stop()
        if self.poll() is None:
            # The job did not end in the controller (a signal, a failure of this node): its own
            # "finished: exit code 1" would contradict the launcher's verdict, printed last.
            controller_log = logging.getLogger("mindft.controller")
            level = controller_log.level
            controller_log.setLevel(logging.WARNING)
            try:
                self.controller.stop(10.0)
            finally:
                controller_log.setLevel(level)
            self.poll()
            log.info("controller stopped by the node agent")
        self.close_metrics()

    def close_metrics(self) -> None:
        """Stop serving the metrics (with the controller)."""
        if self.metrics_server is not None:
            self.metrics_server.close()


class ControllerLink:
    """A node agent's own connection to the controller (nodes other than 0): it carries the agent's
    hellos (every :data:`~mindft.flow.spares.HELLO_INTERVAL`) and exit reports, and brings its ranks'
    orders and the job's view."""

    def __init__(self, spec: LaunchSpec, keys: Any) -> None:
        self._context = zmq.Context()
        identity = f"agent/{spec.node_rank}/{os.getpid()}".encode()
        self._socket = channel.dealer(self._context, keys, spec.controller_address, identity)
        self._address = spec.controller_address
        self._since: Optional[float] = None
        self._heard = False
        self.last_heard: Optional[float] = None  # when the controller last sent anything (None: not yet)
        # As long as a rank waits for the controller's first answer before it gives up.
        timeouts = load_config(spec.env).timeouts
        self._silence_limit = timeouts.dead_after * timeouts.connect_retries

    def send(self, message: Message) -> None:
        try:
            self._socket.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as error:  # the controller is away: hellos repeat, a lost exit report shows as silence
            log.debug("could not send %s to the controller: %s", type(message).__name__, error)

    def receive(self, now: float) -> list[Message]:
        if self._since is None:
            self._since = now
        messages = []
        while self._socket.poll(0):
            self._heard, self.last_heard = True, now
            try:
                messages.append(decode(self._socket.recv()))
            except ProtocolError as error:
                log.warning("dropped a frame from the controller: %s", error)
        if not self._heard and now - self._since >= self._silence_limit:
            self._heard = True  # said once
            log.error("no mindft controller answers this node agent at %s (waited %g s): %s", self._address,
                      self._silence_limit, channel.UNREACHABLE_CAUSES)
        return messages

    def silent_for(self, now: float) -> float:
        """Seconds since the controller last sent anything on this link (or since it was opened)."""
        return now - (self.last_heard if self.last_heard is not None else self._since if self._since is not None
                      else now)

    @property
    def silence_limit(self) -> float:
        """As long as a rank waits for a silent controller before it gives up."""
        return self._silence_limit

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()
