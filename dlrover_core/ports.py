"""Free TCP ports picked by the OS for servers that this process is about to start
(``ray start`` of a local cluster, a rendezvous, a ``redis-server``)."""

from __future__ import annotations

import collections
import socket

__all__ = ["free_port", "free_ports"]

#: ports this process handed out lately: a port is free again for the OS as soon as its
#: probe socket closes, so without this the next pick may return it before its user
#: (a ``ray start`` still starting) has bound it; measured: one node's six ports, picked
#: one after the other, held the same port twice (Ray refused to start)
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=512)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` (``""``: every interface) a
    moment ago: the OS picks them, all bound at once, and none was handed out by this
    process among its last 512.

    Raises:
        ValueError: ``n`` < 1.
        OSError: the OS has no free port left.
    """
    if n < 1:
        raise ValueError(f"free_ports(n={n!r}): allowed: 1 or more")
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                ports.append(port)
        _HANDED_OUT.extend(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (see :func:`free_ports`)."""
    return free_ports(1, host)[0]
