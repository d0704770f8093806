"""Sockets, keys and addresses: every ZeroMQ socket of the control channel is built here.

- ``channel``: the control channel's sockets and their options, the rank's I/O loop, one-off requests
- ``keys``: the job's CurveZMQ key pair: generate, load (0600 only), secure sockets, ZAP
- ``address``: who holds a TCP port on this host; the address this node reaches another by
"""
