"""The ports tests give their servers: distinct, free, and (on a kernel
whose ephemeral range leaves room below it) out of that range, each xdist
worker in a block of its own."""

from __future__ import annotations

import socket

import pytest

from tests import ports


def test_ports_are_distinct_and_free() -> None:
    given = [ports.free_port() for _ in range(50)]
    assert len(set(given)) == 50
    for port in given:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_ports_come_from_this_workers_block_below_the_ephemeral_range() -> None:
    block = ports._block()
    if not ports._below_ephemeral(block):
        pytest.skip("this kernel's ephemeral range leaves no room below it")
    assert all(ports.free_port() in block for _ in range(20))


@pytest.mark.parametrize("workers", [("", "gw0", "gw1", "gw2")])
def test_each_worker_has_a_block_of_its_own(workers: tuple[str, ...],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = []
    for worker in workers:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        blocks.append(set(ports._block()))
    assert all(not (a & b) for i, a in enumerate(blocks) for b in blocks[i + 1:])
