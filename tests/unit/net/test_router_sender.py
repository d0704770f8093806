"""The controller's ROUTER sender: a peer behind a relay is reached through the relay's link, with
the rank's identity (b"": every rank of the relay) in a frame of its own; the routes of a set of
broadcast peers are worked out once and reused while the set stays the same."""
from __future__ import annotations

import zmq

from mindft.net.channel import RouterSender


def test_a_broadcast_reaches_relays_and_ranks_again_and_again_and_a_new_set_of_peers_too() -> None:
    context = zmq.Context()
    try:
        router = context.socket(zmq.ROUTER)
        router.bind("inproc://router-sender")
        relay, rank = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        for sock, identity in ((relay, b"agent/0/1"), (rank, b"rank5.inc0")):
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.connect("inproc://router-sender")
            sock.send(b"hello")
            router.recv_multipart()
        sender = RouterSender(router)
        peers = (b"agent/0/1#", b"rank5.inc0")
        for frame in (b"pause", b"rollback"):
            sender.to_all(peers, frame)
            assert relay.recv_multipart() == [b"", frame] and rank.recv_multipart() == [frame]
        sender.to_all((b"agent/0/1#rank3.inc0",), b"leave")
        sender.to(b"rank5.inc0", b"beat")
        sender.to_all((b"gone",), b"nobody")  # an unknown peer: dropped, never raised
        assert relay.recv_multipart() == [b"rank3.inc0", b"leave"] and rank.recv_multipart() == [b"beat"]
    finally:
        context.destroy(0)
