"""The controller: the shell that runs :class:`mindft.flow.Job` on a real clock.

- ``shell``: the ZeroMQ loop, the job's timers, orders delivered to the owning node agent
- ``__main__``: ``python -m mindft.controller``, a controller configured from the environment
"""
from __future__ import annotations

from mindft.controller.shell import LOCAL_AGENT, Controller, job_budget

__all__ = ["LOCAL_AGENT", "Controller", "job_budget"]
