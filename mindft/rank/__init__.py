"""The rank side: what runs inside each training process, framework-neutral.

- ``engine``: the rank engine (store, capture, restore, replication, dump, leave), one for every backend
- ``loop``: the engine's coordinator seam, and mindft's coordinator (:class:`~mindft.rank.loop.RankLoop`:
  join, the end of each step, faults, finish) over the processor; MindIO's is :mod:`mindft.mindio.loop`
- ``processor``: the rank's ZeroMQ shell around :mod:`mindft.flow.follower`
- ``link``: the I/O thread's loop over the rank's DEALER (heartbeats, reconnects, giving up)
- ``agent_watch``: the rank's watch of its node agent (a pidfd): the agent gone, the rank ends
- ``faults``: which exceptions are device faults (and which are the user's own)
"""
