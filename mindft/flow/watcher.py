"""The reset-file watcher's supervision: a watcher thread that dies is started again, a bounded
number of times, because a job whose device faults go unseen cannot be protected."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

WATCHER_RESTART_DELAY = 1.0  # before a dead reset-file watcher is started again
WATCHER_MAX_RESTARTS = 10    # then the job fails: device faults would go unseen


@dataclass
class WatcherSupervision:
    """The reset-file watcher thread is restarted when it dies, ``delay`` seconds later, up to
    ``max_restarts`` times; then the job fails, as device faults would go unseen."""

    delay: float = WATCHER_RESTART_DELAY
    max_restarts: int = WATCHER_MAX_RESTARTS
    restarts: int = 0
    died_at: Optional[float] = None

    def on_dead(self, now: float) -> Union[str, bool]:
        """The watcher is found dead at ``now``: True to restart it now, False to wait, or the
        reason to fail the job."""
        if self.restarts >= self.max_restarts:
            return f"the reset-file watcher died {self.restarts + 1} times; device faults can no longer be seen"
        if self.died_at is None:
            self.died_at = now
        if now - self.died_at < self.delay:
            return False
        self.restarts += 1
        self.died_at = None
        return True
