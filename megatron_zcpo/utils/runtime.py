"""Small runtime helpers shared by every layer: a free local TCP port and the model inside its wrappers."""

from __future__ import annotations

import contextlib
import random
import socket


def free_port(count: int = 1, stride: int = 1) -> int:
    """The first of ``count`` TCP ports ``port + i * stride`` on localhost, all free now.

    Drawn at random below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``): a port
    from that range, freed for a server to bind later, can be taken meanwhile by any process's
    outgoing connection (two test workers side by side made that race real). The draw uses the
    system's randomness, so processes that seeded :mod:`random` alike still draw apart.
    """
    span = (count - 1) * stride
    low = _ephemeral_low()
    if low - span <= 10_001:  # no room below the ephemeral range: the kernel's own choice (count == 1)
        if count != 1:
            raise RuntimeError(f"no room for {count} ports below the ephemeral range (it starts at {low})")
        return _bindable_ports([0])
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(10_000, low - span)
        if _bindable_ports([port + i * stride for i in range(count)]):
            return port
    raise RuntimeError(f"no {count} free TCP ports {stride} apart found on 127.0.0.1 below {low}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: IANA's dynamic range
        return 49152


def _bindable_ports(ports) -> int:
    """The first of ``ports`` if all of them bind on 127.0.0.1 at once (port 0: the kernel's choice), else 0."""
    with contextlib.ExitStack() as held:
        bound = []
        for port in ports:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return 0
            bound.append(sock.getsockname()[1])
        return bound[0]


def unwrap(model):
    """The innermost module inside DDP / Float16Module wrappers (those that hold it as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model
