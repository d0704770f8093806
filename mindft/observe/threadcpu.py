"""The CPU time some threads of this process have used: what work beside training takes from its cores.

Replication's sender and keeper threads and their contexts' ZeroMQ I/O threads (where CurveZMQ
encrypts and decrypts) work at once, beside training, on the same cores: how long a push takes
says little of the CPU it takes. Linux gives every thread's user and system time in
``/proc/self/task/<tid>/stat``; a :class:`ThreadCpu` adds up the threads that register
themselves and those of the ZeroMQ contexts it named. Elsewhere :meth:`ThreadCpu.seconds` is None.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Dict, Optional, Set

import zmq

TASKS = Path("/proc/self/task")
# ZMQ_THREAD_NAME_PREFIX is a number: one per meter, its contexts' I/O threads are "42/ZMQbg/IO/0", ...
_PREFIXES = itertools.count(42)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_cpu_seconds(stat: Path) -> float:
    """User plus system CPU seconds from a /proc ``stat`` file (a process's or a thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()  # the name may hold spaces: fields count from its end
    return (int(fields[11]) + int(fields[12])) / _TICK


def _thread_seconds(tid: str) -> Optional[float]:
    """User plus system time of thread ``tid`` of this process (None: it is gone)."""
    try:
        return stat_cpu_seconds(TASKS / tid / "stat")
    except OSError:
        return None


def _thread_name(tid: str) -> str:
    try:
        return (TASKS / tid / "comm").read_text().strip()
    except OSError:
        return ""


class ThreadCpu:
    """Adds up the CPU seconds of the threads given to it, those that ended included."""

    def __init__(self) -> None:
        self._prefix = next(_PREFIXES)
        self._zmq_names = f"{self._prefix}/ZMQbg/"
        self._lock = threading.Lock()
        self._registered: Set[str] = set()
        self._counted: Dict[str, float] = {}  # tid -> its CPU seconds when last read
        self._ended = 0.0  # seconds of the counted threads that are gone

    def name_context(self, context: zmq.Context) -> zmq.Context:
        """Count ``context``'s I/O threads (call it before the context's first socket starts them)."""
        context.set(zmq.THREAD_NAME_PREFIX, self._prefix)
        return context

    def count_this_thread(self) -> None:
        """Count the calling thread from now on, until it ends."""
        with self._lock:
            self._registered.add(str(threading.get_native_id()))

    def add_this_thread(self) -> None:
        """A short-lived thread that was not counted adds the CPU it used, just before it ends."""
        seconds = time.thread_time()
        with self._lock:
            self._ended += seconds

    def seconds(self) -> Optional[float]:
        """CPU seconds the threads have used so far (None: this system does not say)."""
        try:
            alive = set(os.listdir(TASKS))
        except OSError:
            return None
        with self._lock:
            for tid in list(self._counted):
                if tid not in alive:
                    self._ended += self._counted.pop(tid)
            self._registered &= alive  # a number may be reused by a thread that is none of ours
            for tid in alive:
                if tid in self._counted or tid in self._registered or _thread_name(tid).startswith(self._zmq_names):
                    seconds = _thread_seconds(tid)
                    if seconds is not None:
                        self._counted[tid] = seconds
            return self._ended + sum(self._counted.values())
