"""The rank side: what runs inside each training process, framework-neutral.

- ``engine``: the rank engine (store, replication, dump, leave) and its per-step loop
- ``processor``: the rank's ZeroMQ shell around :mod:`mindft.flow.follower`
- ``link``: the I/O thread's loop over the rank's DEALER (heartbeats, reconnects, giving up)
- ``agent_watch``: the rank's watch of its node agent (a pidfd): the agent gone, the rank ends
- ``faults``: which exceptions are device faults (and which are the user's own)
"""
