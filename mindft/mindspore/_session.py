"""The MindSpore front of the rank engine, shared by the ``Model.train`` callback and the custom-loop guard.

A :class:`Session` is a :class:`mindft.rank.engine.RankEngine` (the rank's store, processor,
replication, dump and driver loop) whose state is the network's and the optimizer's Parameters
(:class:`TrainingState`), plus what only MindSpore has: the optimizer pre-hook that lets a
capture overlap the next step, the gate before the collectives, and the global generator's
state in every snapshot. The two front ends only tell it where step boundaries are.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, Mapping, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindft.config import MindftConfig
from mindft.exitcodes import ExitCode
from mindft.flow.elastic import parallel_refusal
from mindft.rank.engine import RankEngine
from mindft.snapshot.store import SnapshotError, SnapshotStore

log = logging.getLogger(__name__)

EXIT_DUMPED = int(ExitCode.DUMPED)


class RewindRequired(RuntimeError):
    """Training must continue from an earlier step than the one the data pipeline is at.

    Raised out of ``Model.train`` by the callback; :func:`mindft.mindspore.train` catches it
    and re-enters ``Model.train`` at batch ``step + 1``.
    """

    def __init__(self, step: int) -> None:
        super().__init__(f"rolled back to step {step}: re-enter training at batch {step + 1} "
                         f"(use mindft.mindspore.train(...) instead of Model.train to do this for you)")
        self.step = step


class StepInterrupted(RuntimeError):
    """The controller acted before this step's collectives: the step is abandoned (nothing in
    it was applied yet) and the rank follows the action; the step is replayed after it."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} interrupted before its collectives by the controller")
        self.step = step


def collective_gate(cell: nn.Cell, optimizer: Optional[nn.Cell]) -> Optional[Tuple[nn.Cell, bool]]:
    """Where a step of ``cell`` is last before its gradients are all-reduced: (the Cell, True
    for a forward pre-hook / False for a forward hook), or None when there is no such Cell.

    A ``DistributedGradReducer`` inside ``cell`` (``Model.train``'s ``TrainOneStepCell`` in data
    parallel mode) is called after the forward and backward passes, just before the all-reduce:
    a pre-hook on it. Otherwise the network's own forward: a hook after it (a custom loop's
    reducer is not known to mindft; the backward pass is still to come). A cell that holds the
    optimizer with no reducer is a whole training step: no gate.
    """
    for _, sub in cell.cells_and_names():
        if isinstance(sub, nn.DistributedGradReducer):
            return sub, True
    if optimizer is not None and any(sub is optimizer for _, sub in cell.cells_and_names()):
        return None
    return cell, False


class TrainingState:
    """Every Parameter that defines where training is: the network's and the optimizer's.

    On CPU ``Parameter.asnumpy()`` returns a view of the parameter's memory, so capture
    reads and restore writes those views directly; elsewhere restore falls back to
    ``ops.assign``.
    """

    def __init__(self, cell: nn.Cell, optimizer: Optional[nn.Cell] = None) -> None:
        params: Dict[str, ms.Parameter] = {}
        for owner in (cell, optimizer):
            if owner is None:
                continue
            for param in owner.get_parameters():
                params.setdefault(param.name, param)
        if not params:
            raise ValueError(f"{type(cell).__name__} has no parameters to protect")
        self.cell = cell
        self.params = params
        probe = next(iter(params.values()))
        self.aliased = bool(np.shares_memory(probe.asnumpy(), probe.asnumpy()))
        if not self.aliased:
            log.warning("Parameter.asnumpy() copies on this device: restores use ops.assign")

    def arrays(self) -> Dict[str, np.ndarray]:
        """The current values (views on CPU: do not let the optimizer run while they are read)."""
        return {name: param.asnumpy() for name, param in self.params.items()}

    def load(self, store: SnapshotStore, step: int, exact: bool = True) -> Mapping[str, Any]:
        """Restore the snapshot of exactly ``step`` (``exact`` False: the newest verified at or
        below it) into the parameters; returns its meta, whose ``step`` is the one restored."""
        if self.aliased:
            snapshot = store.restore(step, into=self.arrays())
        else:
            snapshot = store.restore(step)
            for name, array in snapshot.arrays.items():
                ops.assign(self.params[name], ms.Tensor(np.array(array)))
        if not exact:
            return {**snapshot.meta, "step": snapshot.step}
        if snapshot.step != step:
            raise SnapshotError(f"asked to restore step {step}, the newest verified snapshot is "
                                f"step {snapshot.step}")
        return snapshot.meta


def uses_collectives() -> bool:
    """True once mindspore.communication.init() formed a communicator of several ranks: a
    restarted process cannot rejoin it (MCCL on CPU), so a lost process restarts every worker."""
    from mindspore.communication import get_group_size
    from mindspore.communication._comm_helper import GlobalComm

    return bool(GlobalComm.INITED) and get_group_size() > 1


def elastic_problem(config: MindftConfig) -> str:
    """Why this process's parallel context cannot change its world size (:func:`mindft.flow.elastic.parallel_refusal`)."""
    return parallel_refusal(config, ms.get_auto_parallel_context("parallel_mode"),
                            bool(ms.get_auto_parallel_context("enable_parallel_optimizer")))


def rng_meta() -> Dict[str, Any]:
    """MindSpore's global generator state, JSON-able (ops that draw from it replay exactly)."""
    return {"rng_state": [int(v) for v in ms.get_rng_state().asnumpy().tolist()]}


def set_rng(meta: Mapping[str, Any]) -> None:
    """Put back the generator state recorded by :func:`rng_meta`."""
    state = meta.get("rng_state")
    if state is not None:
        ms.set_rng_state(ms.Tensor(np.asarray(state, dtype=np.uint8)))


class Session(RankEngine):
    """One rank's part in the recovery flow for a MindSpore network (see the module docstring).

    ``state`` names the parameters to protect; ``optimizer`` is the Cell whose call must
    not start while a capture reads the parameters. With ``overlap`` (default: in PyNative
    mode) a forward pre-hook on it waits there, so the copy of step ``s`` overlaps the
    forward and backward passes of step ``s + 1``; otherwise each capture completes at
    the end of its step. If the hook turns out not to run (the optimizer is called
    inside ``ms.jit``), the session notices after one step and stops overlapping.
    ``snapshot_every`` is the engine's (:class:`mindft.rank.engine.RankEngine`).
    """

    def __init__(self, state: TrainingState, optimizer: Optional[nn.Cell],
                 config: Optional[MindftConfig] = None, overlap: Optional[bool] = None,
                 snapshot_every: Optional[int] = None) -> None:
        super().__init__(state, config, snapshot_every)
        self._hook_seen = False
        if overlap is None:
            # Graph mode compiles Cell hooks into the graph (where they break it): PyNative only.
            overlap = ms.get_context("mode") == ms.PYNATIVE_MODE
        self.overlap = bool(overlap) and optimizer is not None
        self._optimizer = optimizer
        self._hook = None
        # Lockstep before the collectives (see _gate_collectives): the hook, and whether it ran
        # in the current step; the action that interrupts a step there is the loop's.
        self._gate = None
        self._gate_seen = True
        if self.enabled and self.overlap:
            self._hook = optimizer.register_forward_pre_hook(self._before_update)

    def start(self, meta: Optional[Mapping[str, Any]] = None, collectives: Optional[bool] = None) -> int:
        """Join the job; restore this rank if it is a restarted one. Returns the step to continue after."""
        if not self.enabled:
            return self.step
        problem = elastic_problem(self.config)
        if problem:
            raise ValueError(f"mindft: {problem}")
        collectives = uses_collectives() if collectives is None else collectives
        step = super().start(meta, collectives)
        if collectives:
            self._gate_collectives()
        return step

    def close(self) -> None:
        """Leave the job: remove the hooks, stop the processor and free the snapshots (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._ungate()
        super().close()

    def begin_step(self) -> None:
        """Called before the step ``self.step + 1`` runs; raises an injected fault there."""
        super().begin_step()
        self._hook_seen = False
        self._gate_seen = self._gate is None

    def end_step(self, meta: Optional[Mapping[str, Any]] = None) -> Optional[int]:
        """Called after step ``self.step + 1`` finished: snapshot, report, obey.

        Returns None to go on, or the step training was rolled back to (the caller
        must continue with the batch after it).
        """
        if self.processor is not None:
            if self.overlap and not self._hook_seen:
                # The optimizer ran without calling our hook (graph mode, or inside ms.jit): a
                # background copy could race with its next update, so copy synchronously.
                log.info("rank=%d optimizer hook not reached (graph mode?): snapshots copy synchronously",
                         self.config.rank)
                self.overlap = False
            if not self._gate_seen:
                # This step ran its collectives without passing the gate (graph mode, ms.jit, or
                # the network was not called): hold the rank at each step's end instead.
                log.info("rank=%d the step did not pass the collective gate: lockstep at the step's end",
                         self.config.rank)
                self._ungate()
                self.loop.lockstep = True
        return super().end_step(meta)

    def capture_meta(self) -> Dict[str, Any]:
        """MindSpore's global generator state goes with every snapshot."""
        return rng_meta()

    def restored_meta(self, meta: Mapping[str, Any]) -> None:
        """Put the generator state of the restored snapshot back."""
        set_rng(meta)

    def _before_update(self, cell: Any, inputs: Any) -> None:
        """Optimizer forward pre-hook: the parameters must not change while they are copied."""
        self._hook_seen = True
        if self.store is not None:
            started = time.perf_counter()
            self.store.wait()
            self._hook_wait += time.perf_counter() - started
        return None

    def _gate_collectives(self) -> None:
        """Lockstep without a wait on the step: instead of holding the rank at the end of step
        ``s`` until every rank finished it (a controller round trip per step), hold it just
        before the all-reduce of step ``s + 1``, which its forward (and backward) pass has
        overlapped with the round trip. A rank that faults after its all-reduce still finds every
        peer short of the next all-reduce; a peer the controller pauses there abandons its step
        (nothing applied yet) and replays it after the recovery. PyNative only (hooks)."""
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            return
        gate = collective_gate(self.state.cell, self._optimizer)
        if gate is None:
            return
        cell, before = gate
        if before:
            self._gate = cell.register_forward_pre_hook(lambda c, inputs: self._pass_gate())
        else:
            self._gate = cell.register_forward_hook(lambda c, inputs, outputs: self._pass_gate())
        self.loop.lockstep = False
        log.info("rank=%d lockstep before the collectives (%s of %s)", self.config.rank,
                 "pre-hook" if before else "hook", type(cell).__name__)

    def _ungate(self) -> None:
        if self._gate is not None:
            self._gate.remove()
            self._gate = None
        self._gate_seen = True

    def _pass_gate(self) -> None:
        """Before this step's collectives: wait until every rank finished the previous step."""
        if self._gate_seen or self.processor is None:
            return None  # once per step (a network called again in the same step passes)
        self._gate_seen = True
        self.reached_collectives()
        started = time.perf_counter()
        action = self.processor.wait_peers(self.step)
        self._hook_wait += time.perf_counter() - started
        if action is not None:
            self.loop.interruption = action
            log.warning("rank=%d step %d interrupted before its collectives by %s", self.config.rank,
                        self.step + 1, action.kind.name)
            raise StepInterrupted(self.step + 1)
        return None


def optimizer_of(network: nn.Cell) -> Optional[nn.Cell]:
    """The optimizer Cell inside a train network (``TrainOneStepCell.optimizer`` or a search)."""
    found = getattr(network, "optimizer", None)
    if isinstance(found, nn.Optimizer):
        return found
    for _, cell in network.cells_and_names():
        if isinstance(cell, nn.Optimizer):
            return cell
    return None


