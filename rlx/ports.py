"""Free TCP ports for the processes rlx starts (trainer rendezvous, engines, router)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that was free a moment ago (the caller's child binds it; a race is unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
