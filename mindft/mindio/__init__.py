"""MindIO TFT as mindft's coordination backend: its controller and processors, mindft's state.

MindIO TFT (the ``mindio_ttp`` wheel, open source in Ascend/mind-cluster) decides *when* ranks
stop, which step they resume from and who repairs whom; mindft's in-memory snapshots do the
work inside its handlers. :class:`MindioController` starts MindIO's controller where MindSpore
would (rank 0 / node 0, and nowhere when MindCluster runs it: ``MINDX_TASK_ID`` set);
:class:`MindioRank` is one rank's processor with its handlers bound to plain callables.

The modules: ``wheel`` (importing the wheel, its environment, its teardown, bounded calls; the
wheel's quirks), ``controller``, ``rank``, ``gate`` (the step gate), ``loop`` (the rank engine's
coordinator over ``rank`` and ``gate``; not imported here: it loads the rank side), ``standin`` (the
shell of MindX's part, whose rules are :mod:`mindft.flow.mindx`) and ``host`` (what node 0's launcher runs).

What a UCE on one rank produces (driven on CPU with 2 and 4 processes, 127.0.0.1, wheel 7.3.0)
---------------------------------------------------------------------------------------------
Every rank, before training: ``tft_init_processor`` → ``tft_register_*_handler`` →
``tft_start_processor`` → ``tft_set_optimizer_replica`` (the data-parallel group; without a
replica the controller can only dump). Every step: ``tft_start_updating_os(step)``, the optimizer
update, ``tft_end_updating_os(step)``; the controller learns each rank's step *only* from these
calls (a rank that never reported a step cannot be repaired).

Faulty rank F, in its training thread, during step s (state of s not complete)::

    tft_report_error(RS_UCE)           returns at once
    tft_wait_next_action()             blocks for the whole recovery
      (controller: ~2 s fixed sleep, collect status, prelock at the newest complete step r
       of F's replicas, typically r = s on the healthy ranks, r = s - 1 on F)
      stop handler(args, ctx)          F: returns at once (the wheel knows F reported)
      clean handler(True, args, ctx)   is_uce_error=True; return 0 = repair from a replica
      repair handler(r, True, [F], {repair_type: RT_UCE_HIGHLEVEL, src: [H], dst: [F]}, ...)
      rollback handler(r, args, ctx)
    → RETRY (0); tft_get_repair_step() = r; training continues at step r + 1

Healthy rank H, in the processor's thread while its training thread is anywhere::

      stop handler(args, ctx)          must make the training thread call
                                       tft_report_error(RS_NORMAL): the wheel blocks the
                                       handler (up to TTP_NORMAL_ACTION_TIME_LIMIT) until it
                                       does; a training thread sitting in
                                       tft_start/end_updating_os at the lock step is held there
                                       until the wheel's tft_reset_limit_step after the handler
      training thread: tft_report_error(RS_NORMAL); tft_wait_next_action()
      clean handler(False, ...)        → 0
      repair handler(r, False, [F], {repair_type: RT_SEND, src: [H], dst: [F]}, ...)
      rollback handler(r, ...)
    → RETRY; repair step r.

So after a recovery every rank must hold the state of step r, which F never completed: F copies
it from a source rank's snapshot (mindft keeps snapshots off the device, in the node agent's
replica store), every rank rolls back in place to r. Here: ``repair`` on a target calls
``restore(r, source)``, ``rollback`` calls ``restore(r, None)`` everywhere.

A rank killed (SIGKILL) is noticed by missing heartbeats (~10 s), is a node error, and without
MindCluster's ARF MindIO cannot restart it: it goes to DUMP, ``save_ckpt`` handler(step,
[{type, ranks}], args, ctx) on one live replica in a new thread, ``rename`` handler(step, ctx),
then ``exit`` handler(ctx) on every live rank, and its controller stops. MindSpore's exit handler
calls ``os._exit(1)``; here the training thread is interrupted and :class:`MindioExit` is raised
with a dying-gasp exit code, and a rank that does not get out within ``exit_grace`` seconds is
ended with ``os._exit`` (a MindSpore CPU collective cannot be aborted).

A hot reset (the device plugin's reset file), with MindX's callbacks registered (driven on CPU, 2 ranks)
-------------------------------------------------------------------------------------------------------
With the four MindX callbacks registered before ``tft_init_controller(..., enable_arf=True)`` and
processors started with ``enable_arf=True``, MindIO's controller asks MindX at every fault
(``report_fault_ranks`` → ``stop_train`` → ``report_stop_complete`` → ``on_global_rank`` →
``report_strategies`` → ``change_strategy`` → ``report_result``); MindX may also start an episode
with ``tft_notify_controller_stop_train({rank: 1})`` (1 = process error: that rank gets no
stop/clean/prelock). Strategy ``recover`` (ARF): the controller marks the rank offline and waits
(up to 10 min) for a new process of it; the new processor's registration carries a non-zero
repair id (``tft_is_reboot_node()``), it reports ``RS_INIT_FINISH``, ``tft_wait_next_action``
returns after the group rebuild (``rebuild_group`` handler), it reports ``RS_PREREPAIR_FINISH``
and waits through ``repair`` (the new rank is a target) and ``rollback`` like every rank.
``change_strategy("dump")`` during that wait makes it dump and exit instead. A process that
leaves must NOT call ``tft_destroy_processor``: a processor that reports its exit makes the
controller stop serving the job. :class:`MindxStandIn` is the MindX side node 0's launcher plays
(its rules: :mod:`mindft.flow.mindx`).
"""
from __future__ import annotations

from mindft.mindio.controller import (CONTROLLER_CLOSE_TIMEOUT, MINDX_ACTIONS, MINDX_TASK_VARIABLE, MindioController,
                                      controller_runs_here)
from mindft.config import STEP_GATE_VARIABLE
from mindft.mindio.gate import GATE_HOLD_SECONDS, GATE_UNREACHABLE_AFTER, StepGate, StepGateClient
from mindft.mindio.host import MindioHost
from mindft.mindio.rank import (DEFAULT_EXIT_GRACE, PROCESSOR_CLOSE_TIMEOUT, MindioExit, MindioRank, RankCallbacks,
                                RecoveryRequested, ResetRequested)
from mindft.mindio.standin import MindxStandIn
from mindft.mindio.wheel import MindioError

__all__ = ["CONTROLLER_CLOSE_TIMEOUT", "DEFAULT_EXIT_GRACE", "GATE_HOLD_SECONDS", "GATE_UNREACHABLE_AFTER",
           "MINDX_ACTIONS", "MINDX_TASK_VARIABLE", "PROCESSOR_CLOSE_TIMEOUT", "STEP_GATE_VARIABLE",
           "MindioController", "MindioError", "MindioExit", "MindioHost", "MindioRank", "MindxStandIn",
           "RankCallbacks", "RecoveryRequested", "ResetRequested", "StepGate", "StepGateClient", "controller_runs_here"]
