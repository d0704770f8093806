"""The node side: the node agent that outlives its workers and carries out :mod:`mindft.flow.agent`.

- ``shell``: the node agent: processes, shared-memory state, replicas of a lost node
- ``links``: how the agent reaches the controller (in-process on node 0, a ZeroMQ link elsewhere)
- ``gasp``: the agent's dying gasp: its ranks' state and lost nodes' replicas at one step
- ``workers``: process mechanics: start, signal, monitor workers; MindSpore's scheduler; the console
- ``warm``, ``zygote``: warm starts: the preloaded process and the workers forked from it
- ``plan``: what mindft-launch is asked to run, validated; each process's environment (msrun's)

Nothing is imported here: the warm process imports ``zygote`` alone, before the job's modules.
"""
