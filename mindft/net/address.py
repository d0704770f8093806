"""Ports and addresses of this host: who holds a TCP port (the launcher refuses a taken port before
anything starts, the node agent waits for MindSpore's scheduler to listen or to let go), and the
address this node reaches another by."""
from __future__ import annotations

import socket
from typing import Optional

import psutil

__all__ = ["node_ip", "port_in_use", "port_listening"]


def _listeners(port: int) -> list:
    return [connection for connection in psutil.net_connections("tcp")
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port]


def port_listening(port: int) -> bool:
    """True when a socket of this host listens on TCP ``port`` (no connection is made)."""
    return bool(_listeners(port))


def port_in_use(ip: str, port: int) -> Optional[str]:
    """None when a server could bind ``ip:port`` now; else the rest of a sentence saying who holds it
    (" by pid P (name)" when this user may see it, else "")."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family) as probe:
        # As the servers do (ZeroMQ, MindSpore): a port in TIME_WAIT is free, a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
            return None
        except OSError:
            pass
    for listener in _listeners(port):
        if listener.pid is None:
            continue
        try:
            return f" by pid {listener.pid} ({psutil.Process(listener.pid).name()})"
        except psutil.Error:
            return f" by pid {listener.pid}"
    return ""


def host_address(name: str) -> Optional[str]:
    """The IP address ``name`` (a host name, such as a Volcano pod's, or an IP) resolves to now; None
    when it does not resolve."""
    try:
        return socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except socket.gaierror:
        return None


def node_ip(toward: str) -> str:
    """The local address this node uses to reach ``toward`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in toward else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((toward, 9))
            return probe.getsockname()[0]
    except OSError:
        return toward
