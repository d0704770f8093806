"""Sockets, keys and addresses: every ZeroMQ socket of mindft is built here.

- ``channel``: the control channel's sockets and their options, inproc pipes, one-off requests
- ``sockets``: replication's sockets (keeper, sender, one-off requests) and MindIO's step gate's
- ``keys``: the job's CurveZMQ key pair: generate, load (0600 only), secure sockets, ZAP
- ``address``: who holds a TCP port on this host; the address this node reaches another by
"""
