"""Per-node process plan and supervisor: `dsv4rl train` starts engines and trainer, watches, tears down."""

from dsv4rl.launcher.plan import PortInUse, ProcessSpec, build_local_plan, check_ports, engine_urls
from dsv4rl.launcher.run import run_training
from dsv4rl.launcher.supervisor import Supervisor

__all__ = [
    "PortInUse",
    "ProcessSpec",
    "Supervisor",
    "build_local_plan",
    "check_ports",
    "engine_urls",
    "run_training",
]
