"""Replication wired to its users: a rank replicating itself, or a node agent replicating its ranks.

- **node agents** (``mindft-launch`` on several nodes, :class:`NodeReplication`): a rank's two
  snapshot slots are files in its agent's shared memory (``state_dir/rank<R>/slot<i>.bin``, with
  ``slot<i>.json`` written once a capture is complete). The agent's sender notices a new
  manifest and streams that slot file to the keeper of the next node's agent, which keeps the
  replicas in its own shared memory.
- **ranks with no agent replicating them** (started by hand or by msrun, or
  ``MINDFT_AGENT_REPLICATION=0``, :class:`RankReplication`): the rank streams its
  :class:`~mindft.snapshot.store.SnapshotStore` slot itself, zero-copy, to the keeper in its buddy
  rank's process. The capture never waits for it: a capture that claims the slot while it is
  being sent makes the push fail its check before it is sealed, and the next one goes.
"""
from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Tuple

from mindft.flow.replicas import ReportHold
from mindft.flow.topology import Topology
from mindft.net.keys import CurveKeys
from mindft.protocol import ReplicaReport
from mindft.replica.keeper import Keeper
from mindft.replica.sender import ACK_TIMEOUT, FIND_INTERVAL, REPORT_INTERVAL, Sender
from mindft.replica.sources import StoreSource, slot_files
from mindft.net.address import node_ip
from mindft.snapshot.store import SnapshotStore
from mindft.observe.units import size_text
from mindft.observe.threadcpu import ThreadCpu

log = logging.getLogger(__name__)


class RankReplication:
    """A rank's own replication when no node agent replicates it (see the module docstring).

    The session tells it of each capture (:meth:`captured`) and restore (:meth:`restored`);
    a :class:`Sender` streams the store's newest snapshot to the keeper at ``find_keeper()``
    (the buddy rank's). :meth:`reportable` is the newest step this rank may report finished
    (the rule: :class:`mindft.flow.replicas.ReportHold`); ``release()`` is called (from the
    sender's thread) when a held report may go. A replica later than ``lost_after`` seconds is
    lost protection: logged, reported, and the reports go on without it until it is back.
    """

    def __init__(self, rank: int, store: SnapshotStore, keys: Optional[CurveKeys],
                 find_keeper: Callable[[], Optional[str]], report: Optional[Callable[[ReplicaReport], None]],
                 release: Callable[[], None], lost_after: float, ack_timeout: float = ACK_TIMEOUT,
                 cpu: Optional[ThreadCpu] = None) -> None:
        self.rank = rank
        self._source = StoreSource(store)
        self._release = release
        self._lock = threading.Lock()
        self._hold = ReportHold()
        self.sender = Sender({rank: self._source}, keys, find_keeper, node=-1, report=report,
                             lost_after=lost_after, ack_timeout=ack_timeout, cheap_lookup=True,
                             on_change=self._changed, cpu=cpu)
        store.on_complete = self.sender.wake

    @classmethod
    def attach(cls, processor: Any, store: SnapshotStore, buddy: int, lost_after: float,
               keys: Optional[CurveKeys], cpu: Optional[ThreadCpu] = None) -> RankReplication:
        """Replicate ``processor``'s rank to ``buddy``'s keeper (from the processor's endpoint map),
        with reports to the controller and the step reports held back as :meth:`reportable` says."""
        replication = cls(processor.rank, store, keys, lambda: processor.endpoint_of(buddy),
                          processor.report_replica, processor.release_reports, lost_after, cpu=cpu)
        processor.report_limit = replication.reportable
        return replication

    def captured(self, seq: int, step: int) -> None:
        """The store started capturing ``step`` as capture ``seq`` (training thread)."""
        with self._lock:
            self._hold.captured(seq, step)
        self.sender.wake()

    def restored(self, step: int) -> None:
        """Training was rolled back to ``step``: the replica must hold it again before reports go on."""
        with self._lock:
            self._source.epoch = self._hold.restored(step)
        self.sender.wake()

    def reportable(self, position: int) -> int:
        """The newest step, at most ``position``, this rank may report finished now."""
        with self._lock:
            return self._hold.reportable(position, self.rank in self.sender.lost)

    @property
    def unconfirmed(self) -> Tuple[int, ...]:
        """Steps captured (or restored) whose replica has not been confirmed yet."""
        with self._lock:
            return self._hold.unconfirmed

    def close(self) -> None:
        """Stop sending (what is in flight is dropped)."""
        self._source.store.on_complete = None
        self.sender.close()

    def _changed(self) -> None:
        token = self.sender.confirmed(self.rank)
        if token is not None:
            with self._lock:
                self._hold.confirmed(*token)  # (capture seq, epoch)
        self._release()


class NodeReplication:
    """The keeper and the sender of one node agent, wired to the job's controller."""

    def __init__(self, state_dir: Path, local_ranks: Sequence[int], nproc: int, nnodes: int, node_rank: int,
                 master_ip: str, controller_address: str, keys: Optional[CurveKeys],
                 spill: Optional[Path] = None) -> None:
        from mindft.net.channel import request  # the control channel; imported here to keep this module light
        from mindft.protocol import StatusReply, StatusRequest

        self._request, self._status_request, self._status_type = request, StatusRequest, StatusReply
        self._address, self._keys = controller_address, keys
        self._topology, self._node = Topology(nproc, nnodes), node_rank
        cpu = ThreadCpu()  # the node's replication, both ends: what the overhead budget counts
        self.cpu = cpu  # read by the node's metrics
        self.keeper = Keeper(Path(state_dir) / "replicas", node_ip(master_ip), keys,
                             local=slot_files([Path(state_dir) / f"rank{rank}" for rank in local_ranks]), spill=spill,
                             cpu=cpu, own=lambda rank: Path(state_dir) / f"rank{rank}" if rank in local_ranks else None)
        self.sender = Sender({rank: Path(state_dir) / f"rank{rank}" for rank in local_ranks}, keys,
                             self._find_keeper, node=node_rank, report=self._send_report, cpu=cpu)

    @property
    def endpoint(self) -> str:
        """This node's keeper: the ranks announce it when they register."""
        return self.keeper.endpoint

    def follow(self, controller_address: str) -> None:
        """The job's controller moved there (a standby took over): ask and report to it from now on."""
        self._address = controller_address

    def _find_keeper(self) -> Optional[str]:
        try:
            status = self._request(self._address, self._keys, self._status_request(), FIND_INTERVAL * 2)
        except Exception as error:
            log.debug("cannot ask the controller for the buddy node's keeper: %s", error)
            return None
        endpoints = {row.rank: row.replica_endpoint for row in getattr(status, "ranks", ())}
        return self._topology.keeper_endpoint(self._node, endpoints) or None

    def _send_report(self, report: ReplicaReport) -> None:
        self._request(self._address, self._keys, report, REPORT_INTERVAL * 5)

    def summary(self) -> str:
        """One line for the end of the job: what was sent and what is held."""
        sent, held = self.sender.replicated, self.keeper.held
        return (f"replication: sent {self.sender.pushes} replica(s) (newest confirmed per rank: {sent}; "
                f"{self.sender.skipped} skipped as overwritten while read, {self.sender.timeouts} unconfirmed); "
                f"holding {len(held)} replica(s) of the previous node ({held}, {size_text(self.keeper.nbytes)}; "
                f"received {size_text(self.keeper.received_bytes)}, shared {size_text(self.keeper.shared_bytes)} "
                f"with this node's snapshots; {self.keeper.spilled} moved to disk while the next arrived)")

    def close(self) -> None:
        """Stop sending and serving."""
        self.sender.close()
        self.keeper.close()

    def discard(self) -> int:
        """Stop, and remove the replicas this node keeps (an elastic job's resize: they name ranks by
        the old numbering and nodes that may be gone, and the new ring replicates anew); the bytes freed."""
        self.close()
        home = self.keeper.home
        if home is None:
            return 0
        freed = sum(path.stat().st_size for path in home.rglob("*") if path.is_file())
        shutil.rmtree(home, ignore_errors=True)
        return freed
