import os
import socket

import psutil

from mindft.net.address import port_in_use, port_listening


def test_a_listening_port_is_seen_without_connecting_to_it() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        assert not port_listening(port)  # bound, not yet listening: MindSpore's scheduler is not up
        server.listen()
        assert port_listening(port)


def test_a_taken_port_names_its_holder_and_a_free_one_is_free() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        server.listen()
        assert port_in_use("127.0.0.1", port) == f" by pid {os.getpid()} ({psutil.Process().name()})"
    assert port_in_use("127.0.0.1", port) is None
