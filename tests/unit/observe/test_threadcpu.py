"""ThreadCpu: the CPU of chosen threads of this process, read from /proc (real threads, real ZeroMQ).

Each thread burns CPU until its own CPU clock says so, so the figures do not depend on how
busy the machine is; the bounds leave room for /proc's 10 ms ticks.
"""
from __future__ import annotations

import threading
import time

import zmq

from mindft.net.keys import CurveKeys, secure_client, secure_server
from mindft.observe.threadcpu import ThreadCpu


def burn(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def in_thread(work) -> None:
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_counts_the_threads_that_register_and_keeps_their_time_once_they_ended() -> None:
    cpu = ThreadCpu()
    start = cpu.seconds()
    assert start is not None  # Linux: the suite runs where mindft does
    ready, go_on = threading.Event(), threading.Event()

    def counted() -> None:
        cpu.count_this_thread()
        burn(0.3)
        ready.set()
        go_on.wait()

    thread = threading.Thread(target=counted)
    thread.start()
    ready.wait()
    alive = cpu.seconds() - start
    go_on.set()
    thread.join()
    assert 0.28 <= alive < 0.5
    assert cpu.seconds() - start >= alive  # the thread is gone: what it used stays counted
    in_thread(lambda: burn(0.3))  # not registered: not counted
    assert cpu.seconds() - start < alive + 0.1


def test_a_short_lived_thread_adds_its_own_time_as_it_ends() -> None:
    cpu = ThreadCpu()
    start = cpu.seconds()

    def short() -> None:
        burn(0.2)
        cpu.add_this_thread()

    in_thread(short)
    assert 0.19 <= cpu.seconds() - start < 0.4


def test_counts_the_zeromq_io_threads_of_the_contexts_it_named_where_curvezmq_encrypts() -> None:
    sending_cpu, receiving_cpu, idle_cpu = ThreadCpu(), ThreadCpu(), ThreadCpu()
    keys = CurveKeys(*zmq.curve_keypair())
    sending_context = sending_cpu.name_context(zmq.Context())
    receiving_context = receiving_cpu.name_context(zmq.Context())
    meters = (sending_cpu, receiving_cpu, idle_cpu)
    try:
        start = [meter.seconds() for meter in meters]
        sending, receiving = sending_context.socket(zmq.PAIR), receiving_context.socket(zmq.PAIR)
        secure_server(receiving, keys)
        secure_client(sending, keys)
        port = receiving.bind_to_random_port("tcp://127.0.0.1")
        sending.connect(f"tcp://127.0.0.1:{port}")
        payload = bytes(8 * 1024 * 1024)
        for _ in range(12):  # 96 MiB, encrypted in one context's I/O thread, decrypted in the other's
            sending.send(payload)
            assert len(receiving.recv()) == len(payload)
        sending.close(linger=0)
        receiving.close(linger=0)
        used = [meter.seconds() - before for meter, before in zip(meters, start)]
        assert used[0] >= 0.02 and used[1] >= 0.02  # the main thread (not counted) only copied the frames
        assert used[2] == 0.0  # a meter counts the contexts it named, not every meter's
    finally:
        sending_context.term()
        receiving_context.term()
