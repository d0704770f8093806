"""The step gate: no rank starts step k + 1 before every rank finished k; a hot reset gathers them at one step.

MindIO locks every healthy rank at the newest step any rank reported (the controller's
SelectLockStep): ranks that drift further apart than one step make its prelock fail and the job
dump. A data-parallel job's all-reduce keeps them together; mindft's examples train one shard
per rank without a collective (MindSpore's CPU collectives cannot be aborted), so on mindft-launch
the gate plays the all-reduce's part. :class:`StepGate` is its server on node 0's launcher,
:class:`StepGateClient` a rank's side.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence

import zmq

from mindft.net import sockets
from mindft.net.keys import CurveKeys, start_authenticator
from mindft.mindio.rank import MindioRank, ResetRequested
from mindft.mindio.wheel import MindioError

log = logging.getLogger(__name__)

GATE_HOLD_SECONDS = 0.1  # a request waits at most this long at the gate, so its rank can check MindIO
GATE_UNREACHABLE_AFTER = 30.0  # silence after which a rank gives up on the gate
_GATE_POLL_MS = 10
_ALL_FINISHED = -1


class StepGate:
    """The gate's server (node 0's launcher): a ZeroMQ ROUTER in one thread, CurveZMQ with ``keys``.

    A request ``{"rank", "done", "finished", "need"}`` records where the rank is (a rank that
    rolled back reports a lower ``done``) and is answered ``{"open": true}`` once every rank has
    done at least ``need`` steps (``need == -1``: every rank finished), else ``{"open": false}``
    after :data:`GATE_HOLD_SECONDS`. For a hot reset the launcher holds the gate (:meth:`hold`: the
    ranks gather at the newest step any of them finished, :meth:`gathered`) and tells the ranks
    on the chip to :meth:`leave` (``{"leave": true}``). ``when_all_finished`` runs once, in its own
    thread, when every rank first reported it finished; the ranks' last wait opens after it returned.
    """

    def __init__(self, world_size: int, ip: str, keys: Optional[CurveKeys] = None, port: int = 0,
                 when_all_finished: Optional[Callable[[], Any]] = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._context = zmq.Context()
        self._authenticator = start_authenticator(self._context, keys)
        self._socket, self.endpoint = sockets.gate_router(self._context, keys, ip, port)
        self._done: Dict[int, int] = {}
        self._finished: Dict[int, bool] = {}
        # A hot reset (the launcher's MindxStandIn) holds the ranks at one common step and tells
        # the ranks on the chip to leave. Written from another thread: guarded by _lock.
        self._lock = threading.Lock()
        self._holding = False
        self._leaving: set = set()
        self._parked: Dict[int, int] = {}  # rank -> done, while refused and not let through since
        self._when_all_finished = when_all_finished
        self._ending: Optional[threading.Thread] = None
        self._ended = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mindft-step-gate", daemon=True)
        self._thread.start()
        log.info("step gate for %d ranks on %s (%s)", world_size, self.endpoint, "curve" if keys else "insecure")

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    def hold(self) -> None:
        """Let no rank start a step beyond the newest any rank finished: the ranks gather at one step."""
        with self._lock:
            self._holding = True

    def release(self) -> None:
        """End :meth:`hold`."""
        with self._lock:
            self._holding = False

    def leave(self, ranks: Sequence[int]) -> None:
        """Answer ``ranks``' next requests ``{"leave": true}``: they must exit (their chip is reset)."""
        with self._lock:
            self._leaving.update(ranks)

    def rejoin(self, rank: int) -> None:
        """``rank`` starts again (a new process): serve it normally."""
        with self._lock:
            self._leaving.discard(rank)
            self._parked.pop(rank, None)

    @property
    def joined(self) -> bool:
        """Every rank has asked the gate at least once (it knows where each one is)."""
        with self._lock:
            return len(self._done) >= self.world_size

    def gathered(self) -> Optional[int]:
        """While holding: the step every rank waits at, once they all do (None before)."""
        with self._lock:
            parked = [self._parked.get(rank) for rank in range(self.world_size)]
        if any(done is None for done in parked) or len(set(parked)) != 1:
            return None
        return parked[0]

    def _open(self, need: int) -> bool:
        if len(self._done) < self.world_size:
            return False
        if need == _ALL_FINISHED:
            return all(self._finished.values()) and self._end()
        if self._holding and need >= max(self._done.values()):
            return False  # only the ranks behind catch up
        return min(self._done.values()) >= need

    def _end(self) -> bool:
        """Every rank finished: whether ``when_all_finished`` has returned (started on the first call)."""
        if self._when_all_finished is None:
            return True
        if self._ending is None:
            self._ending = threading.Thread(target=self._run_when_all_finished, name="mindft-gate-end",
                                            daemon=True)
            self._ending.start()
        return self._ended.is_set()

    def _run_when_all_finished(self) -> None:
        try:
            self._when_all_finished()
        except Exception:  # the ranks must still be let out
            log.exception("step gate: the action once every rank finished failed")
        finally:
            self._ended.set()

    def _answer(self, rank: int, need: int, deadline: float, now: float) -> Optional[bytes]:
        """The answer to a waiting request, or None to keep it waiting."""
        with self._lock:
            if rank in self._leaving:
                return b'{"leave": true}'
            if self._open(need):
                self._parked.pop(rank, None)
                return b'{"open": true}'
            if now >= deadline:
                self._parked[rank] = self._done[rank]
                return b'{"open": false}'
        return None

    def _serve(self) -> None:
        waiting: list = []  # (identity, rank, need, deadline)
        try:
            while not self._stop.is_set():
                if self._socket.poll(_GATE_POLL_MS):
                    identity, payload = self._socket.recv_multipart()
                    try:
                        request = json.loads(payload)
                        rank, need = int(request["rank"]), int(request["need"])
                        if not 0 <= rank < self.world_size:
                            raise ValueError(f"rank {rank} not in 0..{self.world_size - 1}")
                        with self._lock:
                            self._done[rank] = int(request["done"])
                            self._finished[rank] = bool(request["finished"])
                    except (ValueError, KeyError, TypeError) as error:
                        log.warning("step gate refused a request: %s", error)
                        self._socket.send_multipart([identity, b'{"error": true}'])
                        continue
                    waiting.append((identity, rank, need, time.monotonic() + GATE_HOLD_SECONDS))
                now = time.monotonic()
                still = []
                for identity, rank, need, deadline in waiting:
                    answer = self._answer(rank, need, deadline, now)
                    if answer is None:
                        still.append((identity, rank, need, deadline))
                    else:
                        self._socket.send_multipart([identity, answer])
                waiting = still
        finally:
            self._socket.close(0)


class StepGateClient:
    """A rank's side of the :class:`StepGate`; every wait also checks ``mindio`` for a stop or exit."""

    def __init__(self, endpoint: str, rank: int, keys: Optional[CurveKeys] = None) -> None:
        self.endpoint, self.rank, self._keys = endpoint, rank, keys
        self._context: Optional[Any] = None
        self._socket: Optional[Any] = None

    def _connect(self) -> Any:
        if self._context is None:
            self._context = zmq.Context()
        if self._socket is None:
            self._socket = sockets.gate_dealer(self._context, self._keys, self.endpoint)
        return self._socket

    def wait(self, done: int, need: int, mindio: MindioRank, finished: bool = False) -> None:
        """Report ``done`` steps and block until every rank did ``need`` (-1: every rank finished).

        Raises :class:`RecoveryRequested` / :class:`MindioExit` as soon as MindIO asks for them,
        :class:`ResetRequested` when the launcher says this rank's chip is reset, and
        :class:`MindioError` when the gate stays silent for :data:`GATE_UNREACHABLE_AFTER` s.
        """
        payload = json.dumps({"rank": self.rank, "done": done, "need": need, "finished": finished}).encode()
        last_answer = time.monotonic()
        while True:
            mindio.check()
            socket = self._connect()
            socket.send(payload)
            if socket.poll(GATE_HOLD_SECONDS * 1000 * 5):
                answer = json.loads(socket.recv())
                last_answer = time.monotonic()
                if answer.get("error"):
                    raise MindioError(f"rank {self.rank}: the step gate at {self.endpoint} refused "
                                      f"the request")
                if answer.get("leave"):
                    raise ResetRequested(f"rank {self.rank}: its chip is about to be reset (hot reset)")
                if answer.get("open"):
                    return
                continue
            # No answer: drop the socket (a late reply must not answer the next request).
            socket.close(0)
            self._socket = None
            if time.monotonic() - last_answer > GATE_UNREACHABLE_AFTER:
                raise MindioError(f"rank {self.rank}: the step gate at {self.endpoint} did not answer "
                                  f"for {GATE_UNREACHABLE_AFTER:g} s (is mindft-launch on node 0 alive?)")

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None
