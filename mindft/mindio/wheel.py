"""Plumbing around the ``mindio_ttp`` wheel: its import, its environment, its teardown, bounded calls.

Environment MindIO reads (set before the wheel is imported)
-----------------------------------------------------------
``MINDIO_FOR_MINDSPORE=true`` (else the wheel imports torch; set here), ``TTP_LOG_STDOUT=1``
(set here unless given: ``TTP_LOG_PATH`` crashed rank 0 once in spdlog), ``TTP_LOG_LEVEL``
(WARNING here unless given), ``TTP_NORMAL_ACTION_TIME_LIMIT`` (30..1800 s, how long a handler
waits for the training thread; from ``action_timeout``), ``TTP_RETRY_TIMES`` (connection
attempts), ``MINDX_TASK_ID`` (MindCluster runs the controller), ``MINDIO_WAIT_MINDX_TIME``.

Quirks and how they are handled
-------------------------------
* Importing ``mindio_ttp.framework_ttp`` imports mindspore even with MINDIO_FOR_MINDSPORE=true
  (it reads the device id in ``tft_init_processor``). The rank side accepts that (a training
  process has mindspore loaded anyway); the controller imports only
  ``mindio_ttp.controller_ttp``, which needs no framework.
* ``tft_destroy_processor()`` hangs until the controller is destroyed: it reports the exit, then
  waits for its receive thread, which sits in a blocking ``recv`` that only the controller's
  teardown ends (MindSpore has rank 0 destroy the controller first). Destroying the controller
  takes 3-7 s (its worker threads exit one by one). Both run in a daemon thread with a bounded
  wait; a stuck one is abandoned (waited for once more at exit, below). The wheel's own ``atexit`` hooks
  (which would repeat the unbounded calls at interpreter exit) are unregistered.
* A process that abandoned a destroy aborts at exit ("terminate called without an active
  exception", SIGABRT) when the wheel's C++ static destructors meet the thread still blocked in
  it, or when the call returns while Python finalizes (the thread, taking the GIL, is ended by
  unwinding C++ frames). After an abandoned destroy the process therefore waits at exit, before
  finalizing, up to ``EXIT_WAIT_SECONDS`` for the call to return, and ends with ``_exit(status)``
  once Python has finalized, skipping those destructors and keeping the exit status the program chose.
* A processor destroyed while its controller lives can abort ("pure virtual method called",
  SIGABRT), rarely, under load: the destroy shuts its own connection, its receive thread wakes,
  still sees it connected and reconnects through the link being deleted. The controller's
  destroy first tells every processor it ends, which turns that reconnect off: the launcher
  destroys the controller once every rank finished, and the ranks' last gate opens only then.
* ``tft_init_processor`` makes SIGTERM and SIGINT do nothing. The handlers in place before it are
  put back, so the launcher can still stop a rank.
* Prelock gives up after 3 tries when ranks drift apart (a rank mid-update is given 3 ms); the
  controller then exits or dumps. Ranks of a data-parallel job stay within one step of each
  other through their collectives; :meth:`MindioRank.report_fault` / :meth:`MindioRank.recover`
  raise :class:`MindioExit` when MindIO answers EXIT, never loop.
* The controller sleeps a fixed 2 s (``TTP_SLEEP_TIME``) after noticing a fault before it acts,
  and polls status every 2 s: a recovery takes at least ~2.1 s, however small the job. Nothing
  to handle, only to know (bench/mindio.py measures it).
* ``tft_start_updating_os`` returns normally (MindSpore mode) right after a stop: the stop is
  only visible through the stop handler, so the hooks check the flag it sets and raise
  :class:`RecoveryRequested`.
* The snapshot of a step must be complete before ``tft_end_updating_os(step)`` tells MindIO the
  step exists: capture between the update and :meth:`~mindft.mindio.rank.MindioRank.end_update`; the ``clean``
  handler calls ``settle`` to finish a capture in flight.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import logging
import os
import threading
from types import ModuleType
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

# The wheel accepts 30..1800 s for TTP_NORMAL_ACTION_TIME_LIMIT.
_ACTION_LIMIT_RANGE = (30, 1800)


class MindioError(RuntimeError):
    """The MindIO wheel is missing, refused a call, or was used out of order."""


def set_environment(action_timeout: Optional[float] = None) -> None:
    """Set what MindIO reads at import (see above); ``action_timeout`` bounds a handler's wait."""
    os.environ["MINDIO_FOR_MINDSPORE"] = "true"
    os.environ.setdefault("TTP_LOG_STDOUT", "1")
    os.environ.setdefault("TTP_LOG_LEVEL", "WARNING")
    if action_timeout is not None and "TTP_NORMAL_ACTION_TIME_LIMIT" not in os.environ:
        low, high = _ACTION_LIMIT_RANGE
        os.environ["TTP_NORMAL_ACTION_TIME_LIMIT"] = str(int(min(max(action_timeout, low), high)))


def import_wheel(name: str) -> ModuleType:
    """Import a module of the wheel; :class:`MindioError` saying how to install it when it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise MindioError(f"MindIO TFT is not importable ({error}); install the wheel "
                          f"(pip install mindio_ttp-*.whl) or set MINDFT_BACKEND=mindft") from None


def unregister_atexit(*functions: Callable[..., Any]) -> None:
    """Drop the wheel's own ``atexit`` hooks: they repeat unbounded destroy calls at interpreter exit."""
    for function in functions:
        atexit.unregister(function)


_teardown_skipped = False


def skip_native_teardown_at_exit() -> None:
    """Make ``exit(status)`` call ``_exit(status)`` before the wheel's C++ static destructors run.

    glibc calls ``on_exit`` handlers as ``handler(status, arg)`` in reverse order of registration,
    interleaved with the destructors the wheel registered when it was loaded (earlier), so this
    handler runs first. ``_exit`` reads only its first argument. Python has flushed its own streams
    by then; C stdio buffers are flushed here, the last moment Python code runs at exit.
    """
    global _teardown_skipped
    if _teardown_skipped:
        return
    try:
        libc = ctypes.CDLL(None)
        on_exit, quick_end, flush = libc.on_exit, libc._exit, libc.fflush
    except (OSError, AttributeError) as error:
        log.warning("cannot skip MindIO's native teardown at exit (%s): the process may abort at exit", error)
        return
    flush.argtypes = [ctypes.c_void_p]
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    if on_exit(ctypes.cast(quick_end, ctypes.c_void_p), None) != 0:
        log.warning("on_exit refused a handler: the process may abort at exit (MindIO quirk)")
        return
    atexit.register(flush, None)
    _teardown_skipped = True


# How long a process waits at exit for an abandoned call to come back (the controller's destroy
# takes up to 7 s): a call that returns while the interpreter finalizes aborts the process.
EXIT_WAIT_SECONDS = 10.0


def _let_return(thread: threading.Thread, what: str) -> None:
    """At exit, before the interpreter finalizes: give an abandoned call time to return. Returning
    later, its thread would take the GIL while Python finalizes, which ends the thread by unwinding
    the wheel's C++ frames: std::terminate, SIGABRT, the exit status lost."""
    thread.join(EXIT_WAIT_SECONDS)
    if thread.is_alive():
        log.warning("%s still blocked at exit after %.0f s more", what, EXIT_WAIT_SECONDS)


def bounded(call: Callable[[], Any], timeout: float, what: str) -> bool:
    """Run ``call`` in a daemon thread; True if it returned within ``timeout`` (else it is abandoned)."""
    errors: list = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # reported below; a wheel error must not kill the caller
            errors.append(error)

    thread = threading.Thread(target=run, name=f"mindio-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.warning("%s did not return within %.1f s; abandoned (MindIO quirk)", what, timeout)
        skip_native_teardown_at_exit()
        atexit.register(_let_return, thread, what)
        return False
    if errors:
        log.warning("%s failed: %r", what, errors[0])
        return False
    return True
