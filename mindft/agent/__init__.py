"""The node side: the node agent that outlives its workers and carries out :mod:`mindft.flow.agent`.

- ``shell``: the node agent: its supervise loop, carrying out the policy's effects
- ``services``: what it runs beside its ranks: warm process, controller (node 0), MindIO's host, metrics
- ``memory``: the node's state in shared memory, its replication, its dying gasps from memory, its removal
- ``takeover``: a node that replaces a lost one: its ranks' replicas restored, the loss reported
- ``links``: how the agent reaches the controller (in-process on node 0, a ZeroMQ link elsewhere)
- ``gasp``: the agent's dying gasp: its ranks' state and lost nodes' replicas at one step
- ``workers``: process mechanics: start, signal, monitor workers; MindSpore's scheduler; the console
- ``warm``, ``zygote``: warm starts: the preloaded process and the workers forked from it
- ``plan``: what mindft-launch is asked to run, validated; each process's environment (msrun's)

Nothing is imported here: the warm process imports ``zygote`` alone, before the job's modules.
"""
