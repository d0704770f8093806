from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import zmq

from mindft.config import ConfigError, MindftConfig
from mindft.net.keys import (generate_keys, job_keys, load_keys, secure_client, secure_server,
                         start_authenticator)


def test_generated_key_file_is_private_and_loads_back(tmp_path: Path) -> None:
    path = tmp_path / "run" / "keys.json"
    keys = generate_keys(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_keys(path) == keys
    assert job_keys(MindftConfig(key_file=path)) == keys


def test_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    generate_keys(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable by other users.*chmod 600"):
        load_keys(path)


@pytest.mark.parametrize("content, fragment", [
    ("not json", "is not a mindft key file"),
    ('{"public": "x"}', "is not a mindft key file"),
])
def test_malformed_key_file_is_refused(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match=fragment):
        load_keys(path)


def test_mismatched_key_pair_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    generate_keys(path)
    other_public, _ = zmq.curve_keypair()
    data = json.loads(path.read_text())
    data["public"] = other_public.decode()
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="does not match"):
        load_keys(path)


def test_security_is_never_off_silently(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MINDFT_KEY_FILE is not set.*MINDFT_INSECURE=1"):
        job_keys(MindftConfig())
    with pytest.raises(ConfigError, match="does not exist"):
        job_keys(MindftConfig(key_file=tmp_path / "missing.json"))
    assert job_keys(MindftConfig(insecure=True)) is None


def test_server_admits_only_the_job_key(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys.json")
    context = zmq.Context()
    authenticator = start_authenticator(context, keys)
    server = context.socket(zmq.ROUTER)
    sockets = [server]
    try:
        secure_server(server, keys)
        port = server.bind_to_random_port("tcp://127.0.0.1")

        def client(setup: str) -> zmq.Socket:
            sock = context.socket(zmq.DEALER)
            sock.linger = 0
            sockets.append(sock)
            if setup == "job":
                secure_client(sock, keys)
            elif setup == "stranger":
                public, secret = zmq.curve_keypair()
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                    keys.public, public, secret)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(setup.encode())
            return sock

        client("stranger")
        client("plain")
        client("job")
        received = []
        while server.poll(1000):
            received.append(server.recv_multipart()[-1])
        assert received == [b"job"]
    finally:
        for sock in sockets:
            sock.close(linger=0)
        assert authenticator is not None
        authenticator.stop()
        context.term()


def test_the_insecure_warning_is_logged_once_per_process(caplog) -> None:
    from mindft.net import keys

    keys._insecure_warned.clear()
    config = MindftConfig(insecure=True)
    with caplog.at_level("WARNING", logger="mindft.net.keys"):
        assert job_keys(config) is None and job_keys(config) is None
    assert [r.getMessage() for r in caplog.records].count(
        "MINDFT_INSECURE=1: the control channel is neither authenticated nor encrypted; use this for debugging only") == 1
