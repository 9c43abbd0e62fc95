"""Naming the node the network no longer reaches: a TCP connection to each engine on another node."""

from __future__ import annotations

import socket

from dsv4rl.launcher import reachability
from dsv4rl.launcher.reachability import connect_error, unreachable_engines


def test_a_listening_engine_is_reached_and_a_closed_port_is_refused():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert connect_error("127.0.0.1", port) is None
    assert "refused" in connect_error("127.0.0.1", port).lower()


def test_each_engine_that_does_not_answer_is_named_with_its_node_and_address(monkeypatch):
    answers = {"10.0.0.2": "no answer within 3 s", "10.0.0.3": None, "10.0.0.4": "Connection refused"}
    monkeypatch.setattr(reachability, "connect_error", lambda host, port, timeout_s: answers[host])
    engines = [
        ("engine-0", "http://10.0.0.2:30000/health_generate"),
        ("engine-1", "http://10.0.0.3:30000/health_generate"),
        ("engine-2", "http://10.0.0.4:30001/health_generate"),
    ]
    lines = unreachable_engines(engines, ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"])
    assert lines == [
        "node 1 (10.0.0.2) cannot be reached from this node: engine-0 at 10.0.0.2:30000 does not accept a "
        "connection (no answer within 3 s); the network between the nodes is cut or blocked",
        "node 3 (10.0.0.4): nothing listens at 10.0.0.4:30001, where engine-2 served (Connection refused)",
    ]
    assert unreachable_engines([], ["10.0.0.1"]) == []
