"""``dlrover_core.ports``: the ports handed out for servers about to start are distinct,
also across calls (a node's six Ray ports picked one at a time once held one port twice,
and ``ray start`` refused: "metrics_export is trying to use a port number ... used by other
components")."""

import socket

import pytest

from dlrover_core.ports import free_port, free_ports


def test_ports_are_distinct_within_and_across_calls():
    # 50 nodes' worth: 400 picks, each bound and closed on its own, held a repeat in 20
    # of 20 tries here (random picks from about 28,000 ports collide by the birthday bound)
    picked = [p for _ in range(50) for p in free_ports(8)]
    assert len(set(picked)) == len(picked)


def test_a_picked_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert free_port(host="") != port


def test_bad_count_is_refused():
    with pytest.raises(ValueError, match="n=0"):
        free_ports(0)
