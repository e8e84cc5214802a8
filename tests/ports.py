"""Free loopback ports for the servers a test starts.

A port found free by binding port 0 comes from the kernel's ephemeral range,
where every outgoing connection also takes its local port: between the moment
it is found and the moment the server binds it, a connection of any process
(another pytest-xdist worker's, say) may take it, and the server fails with
"address already in use". So ports are handed out from below that range, each
xdist worker from a block of its own, and checked by binding them."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

FIRST_PORT = 20000
BLOCK = 2000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_given: set[int] = set()


def _block() -> range:
    """This process's ports: a block per xdist worker ("gw0", "gw1", ...), the
    first block without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker[2:].isdigit() else 0
    start = FIRST_PORT + index * BLOCK
    return range(start, start + BLOCK)


def _below_ephemeral(ports: range) -> bool:
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    return ports.stop <= low


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _from_the_kernel() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port() -> int:
    """A port nothing listens on, never one handed out before in this process
    (two servers of one test told the same port would collide)."""
    ports = _block()
    if not _below_ephemeral(ports):  # another kernel's layout: the plain way
        while (port := _from_the_kernel()) in _given:
            pass
        _given.add(port)
        return port
    start = random.randrange(len(ports))  # a child process picking too starts elsewhere
    for offset in range(len(ports)):
        port = ports[(start + offset) % len(ports)]
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    _given.clear()  # all handed out: the earliest are long free again
    return free_port()
