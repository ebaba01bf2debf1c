"""free_port: several ports free at once, below the ephemeral range, apart across processes seeded alike."""

import random
import socket

import pytest

from megatron_zcpo.utils import runtime
from megatron_zcpo.utils.runtime import free_port


def test_a_block_of_ports_binds_at_once_below_the_ephemeral_range():
    low = runtime._ephemeral_low()
    for count, stride in ((1, 1), (3, 1), (2, 10)):
        base = free_port(count, stride)
        assert base >= 10_000 and base + (count - 1) * stride < low  # never a port an outgoing connection takes
        sockets = [socket.socket() for _ in range(count)]
        for index, sock in enumerate(sockets):
            sock.bind(("127.0.0.1", base + index * stride))
        for sock in sockets:
            sock.close()


def test_a_taken_port_in_the_block_is_never_handed_out(monkeypatch):
    """The draw retries past a block whose second port is held (a server started by the other worker)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken - 1, taken - 1, 20_000])

        class Scripted:
            def randrange(self, *_):
                return next(draws)

        monkeypatch.setattr(runtime.random, "SystemRandom", Scripted)
        monkeypatch.setattr(runtime, "_ephemeral_low", lambda: 65_000)
        assert free_port(2) == 20_000


def test_processes_seeded_alike_draw_different_ports():
    random.seed(0)
    first = [free_port() for _ in range(5)]
    random.seed(0)
    assert [free_port() for _ in range(5)] != first


def test_no_room_below_the_ephemeral_range_is_an_error_for_a_block(monkeypatch):
    monkeypatch.setattr(runtime, "_ephemeral_low", lambda: 10_000)
    assert free_port() > 0  # one port: the kernel's choice
    with pytest.raises(RuntimeError, match="no room for 2 ports"):
        free_port(2)
