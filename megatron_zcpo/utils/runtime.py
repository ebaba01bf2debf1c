"""Small runtime helpers shared by every layer: a free local TCP port and the model inside its wrappers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """An unused TCP port on localhost (for single-process or test rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unwrap(model):
    """The innermost module inside DDP / Float16Module wrappers (those that hold it as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model
