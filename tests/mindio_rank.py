"""One process of a tiny data-parallel numpy job on MindIO TFT (the real wheel), for the tests and bench.

``python mindio_rank.py controller WORLD PORT``: MindIO's controller (as node 0's launcher would
run it); prints ``ready`` and serves until stdin closes or SIGTERM.

``python mindio_rank.py rank RANK WORLD PORT HUB STEPS OUT [--fault uce:STEP | kill:STEP]``: one
rank. ``HUB`` is ``host:port|replica endpoint|gate endpoint`` of the harness's hub (see
:func:`serve_hub`): an abortable barrier standing in for the step's all-reduce, a replica keeper
standing in for the node agent that holds every rank's snapshot, and the step gate at which the
ranks wait once finished until the controller is destroyed (as under mindft-launch). Each step:
barrier, begin_update, update from a seeded RNG, capture and push the snapshot, end_update. The
final state goes to ``OUT`` (``.npz``) with a JSON line per event on stdout.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numpy as np

from mindft.mindio import (PROCESSOR_CLOSE_TIMEOUT, MindioController, MindioError, MindioExit, MindioRank,
                           RankCallbacks, RecoveryRequested, StepGate, StepGateClient)
from mindft.protocol import FaultKind
from mindft.replica import Keeper, fetch_replica, push_replica
from mindft.snapshot.store import SnapshotError, SnapshotStore

SIZE = 257
SEED = 1234
BARRIER_TIMEOUT = 60.0
REPLICA_TIMEOUT = 10.0
AUTHKEY = b"mindft-mindio-test"
# A test sets it tiny so that the wheel's destroy is always abandoned.
CLOSE_TIMEOUT = float(os.environ.get("MINDIO_TEST_CLOSE_TIMEOUT", PROCESSOR_CLOSE_TIMEOUT))


def initial_state() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return {"w": rng.standard_normal(SIZE), "m": np.zeros(SIZE), "step": np.zeros((), np.int64)}


def apply_update(state: Dict[str, np.ndarray], step: int) -> None:
    """One optimizer update: the averaged gradient of ``step`` is the same on every rank."""
    gradient = np.random.default_rng([SEED, step]).standard_normal(SIZE)
    state["m"] *= 0.9
    state["m"] += gradient
    state["w"] -= 0.01 * state["m"]
    state["step"][...] = step


def expected_state(steps: int) -> Dict[str, np.ndarray]:
    state = initial_state()
    for step in range(1, steps + 1):
        apply_update(state, step)
    return state


class _Hub(BaseManager):
    pass


def serve_hub(world_size: int, destroy_controller: Callable[[], Any]) -> tuple:
    """Start the barrier, replica and gate servers in this process; (the HUB argument of ranks, closer).

    ``destroy_controller`` runs once every rank finished, before the ranks destroy their processors.
    """
    barrier = threading.Barrier(world_size)
    replicas = Keeper(None, "127.0.0.1", None)
    gate = StepGate(world_size, "127.0.0.1", when_all_finished=destroy_controller)
    _Hub.register("barrier", callable=lambda: barrier)
    manager = _Hub(("127.0.0.1", 0), authkey=AUTHKEY)
    server = manager.get_server()

    def serve() -> None:
        try:
            server.serve_forever()
        except SystemExit:  # how the manager's server leaves serve_forever once stopped
            pass

    threading.Thread(target=serve, name="hub", daemon=True).start()
    host, port = server.address

    def close() -> None:
        server.stop_event.set()
        replicas.close()
        gate.close()

    return f"{host}:{port}|{replicas.endpoint}|{gate.endpoint}", close


def emit(**event: Any) -> None:
    print(json.dumps({"t": time.time(), **event}), flush=True)


def run_controller(world_size: int, port: int) -> int:
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    controller = MindioController(world_size, "127.0.0.1", port)
    controller.start()
    print("ready", flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), stopping.set()), daemon=True).start()
    stopping.wait()
    controller.stop()
    return 0


def run_rank(rank: int, world_size: int, port: int, hub: str, steps: int, out: Path,
             fault: Optional[str]) -> int:
    address, agent, gate_endpoint = hub.split("|")
    host, hub_port = address.rsplit(":", 1)
    _Hub.register("barrier")
    manager = _Hub((host, int(hub_port)), authkey=AUTHKEY)
    manager.connect()
    barrier = manager.barrier()

    state = initial_state()
    store = SnapshotStore()
    store.capture(0, state)
    store.wait()
    push_replica(agent, rank, store.restore(0), None, REPLICA_TIMEOUT)

    def settle() -> None:
        store.wait()
        barrier.reset()

    def restore(step: int, source: Optional[int]) -> None:
        if source is not None:
            store.adopt(fetch_replica(agent, source, None, REPLICA_TIMEOUT, min_step=step))
        snapshot = store.restore(step, into=state)
        if snapshot.step != step:
            raise SnapshotError(f"rank {rank} holds step {snapshot.step}, MindIO wants {step}")
        emit(event="restored", rank=rank, step=step, source=source)

    def dump(reason: str) -> None:
        path = store.dump(out.parent / "dump", rank, world_size)
        emit(event="dumped", rank=rank, path=str(path), reason=reason)

    fault_kind, fault_step = (fault.split(":")[0], int(fault.split(":")[1])) if fault else (None, -1)
    mindio = MindioRank(rank, world_size, "127.0.0.1", port,
                        RankCallbacks(settle=settle, restore=restore, dump=dump, interrupt=barrier.abort),
                        exit_grace=20.0)
    mindio.start()
    emit(event="started", rank=rank, sigterm=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    step, faulted = 1, False
    hook_ns = []  # per step: the begin_update + end_update calls (bench/mindio.py reads them)
    try:
        while step <= steps:
            try:
                try:
                    barrier.wait(BARRIER_TIMEOUT)
                except threading.BrokenBarrierError:
                    mindio.check()  # MindIO aborted the collective: say why
                    raise
                if rank == 0 and step == 1:
                    emit(event="running", rank=rank)
                if step == fault_step and not faulted:
                    faulted = True
                    if fault_kind == "kill":
                        emit(event="killing", rank=rank, step=step)
                        os.kill(os.getpid(), signal.SIGKILL)
                    state["w"][: SIZE // 2] = np.nan  # the UCE hit half-way through the update
                    emit(event="fault", rank=rank, step=step)
                    step = mindio.report_fault(FaultKind.UCE) + 1
                    emit(event="resumed", rank=rank, step=step)
                    continue
                began = time.perf_counter_ns()
                mindio.begin_update(step)
                begun = time.perf_counter_ns()
                apply_update(state, step)
                store.capture(step, state)
                store.wait()
                push_replica(agent, rank, store.restore(step), None, REPLICA_TIMEOUT)
                ending = time.perf_counter_ns()
                mindio.end_update(step)
                hook_ns.append(begun - began + time.perf_counter_ns() - ending)
                step += 1
            except RecoveryRequested:
                step = mindio.recover() + 1
                emit(event="resumed", rank=rank, step=step)
    except MindioExit as exit_order:
        emit(event="exit", rank=rank, code=exit_order.code, reason=exit_order.reason)
        mindio.close()
        return int(exit_order.code)
    np.savez(out, **state)
    emit(event="done", rank=rank, step=step - 1, hook_ns=hook_ns)
    # No rank closes while another still needs the controller, and the controller goes first.
    gate = StepGateClient(gate_endpoint, rank)
    try:
        gate.wait(steps, -1, mindio, finished=True)
    except (MindioError, MindioExit) as error:  # the controller is gone: close all the same
        emit(event="gate", rank=rank, error=str(error))
    finally:
        gate.close()
    closed = mindio.close(CLOSE_TIMEOUT)
    emit(event="closed", rank=rank, clean=closed)
    store.close()
    return 0


def main(argv: list) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {argv[1]} %(name)s %(message)s")
    if argv[1] == "controller":
        return run_controller(int(argv[2]), int(argv[3]))
    fault = argv[argv.index("--fault") + 1] if "--fault" in argv else None
    return run_rank(int(argv[2]), int(argv[3]), int(argv[4]), argv[5], int(argv[6]), Path(argv[7]), fault)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
