"""Where a restarted engine listens when its port was taken: recorded, read, cleared at a launch."""

from __future__ import annotations

from pathlib import Path

from dsv4rl.config.choices import ProcessRole
from dsv4rl.faults import engine_ports
from dsv4rl.launcher.child_faults import ChildFaults
from dsv4rl.launcher.plan import ProcessSpec


def test_a_move_is_recorded_read_and_cleared(tmp_path) -> None:
    assert engine_ports.moved_port(tmp_path, "engine-1") is None
    engine_ports.record_move(tmp_path / "logs", "engine-1", 41234, 30001)
    assert engine_ports.moved_port(tmp_path / "logs", "engine-1") == 41234
    assert engine_ports.moved_port(tmp_path / "logs", "engine-0") is None
    (tmp_path / "logs" / "port-engine-0.json").write_text('{"port": "soon"}')  # not a port: not a move
    assert engine_ports.moved_port(tmp_path / "logs", "engine-0") is None
    engine_ports.clear(tmp_path / "logs", "engine-1")
    assert engine_ports.moved_port(tmp_path / "logs", "engine-1") is None


def test_a_launch_starts_every_engine_on_its_planned_port_again(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    spec = ProcessSpec("engine-1", ["x"], {}, logs / "engine-1.log", ProcessRole.engine)
    engine_ports.record_move(logs, "engine-1", 41234, 30001)
    ChildFaults([spec], []).clear()
    assert engine_ports.moved_port(logs, "engine-1") is None


def test_the_port_of_an_address_is_replaced_whatever_its_host() -> None:
    assert engine_ports.url_with_port("http://127.0.0.1:30000/health_generate", 41) == (
        "http://127.0.0.1:41/health_generate"
    )
    assert engine_ports.url_with_port("http://[::1]:30000", 41) == "http://[::1]:41"
    assert engine_ports.url_with_port("http://node-2", 41) == "http://node-2:41"
