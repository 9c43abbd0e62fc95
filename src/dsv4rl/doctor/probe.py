"""The probe layer: everything `dsv4rl doctor` reads from the machine goes through one `SystemProbe`.

`SystemProbe` reads the live machine, cheaply: package versions from metadata, torch's build from its
`version.py` (torch itself is imported only for a GPU build, to ask NCCL/RCCL and the devices), external
tools with short timeouts and None when they are not installed. `RecordedProbe` answers the same questions
from a JSON machine state (tests/doctor/states/*.json), so the checks can be tested for an MI355X, an
MI300X or an H100 node on a laptop. A state file holds only what differs from "absent": a file, directory,
command, package or port it does not list does not exist (is free).
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from dsv4rl.config.schema import Config
from dsv4rl.launcher.engine_python import InterpreterInfo
from dsv4rl.tools.sandbox.isolation import SandboxFacts


class Limit(StrEnum):
    """The resource limits the doctor reads (names of `resource.RLIMIT_*` without the prefix)."""

    memlock = "memlock"
    nofile = "nofile"


UNLIMITED = -1  # resource.RLIM_INFINITY, and what state files write for it


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str = ""


@dataclass(frozen=True)
class DiskUsage:
    """Bytes of the filesystem holding `path` (the nearest existing parent of the path asked for)."""

    path: str
    total: int
    free: int


@dataclass(frozen=True)
class TorchDevice:
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class TorchInfo:
    """torch as the trainer sees it. `cuda`/`hip`: the toolkit it was built for (None: not that build)."""

    version: str | None
    cuda: str | None = None
    hip: str | None = None
    nccl: str | None = None  # NCCL's version, RCCL's on a ROCm build
    devices: list[TorchDevice] = field(
        default_factory=list
    )  # the devices torch sees (visibility masks apply)
    error: str | None = None  # torch failed to import or to answer


class SystemProbe:
    """The live machine. Every method is cheap (no torch import on a CPU build, no slow tools)."""

    command_timeout_s = 10.0

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def hostname(self) -> str:
        return socket.gethostname()

    def python_version(self) -> str:
        return platform.python_version()

    def cwd(self) -> str:
        return os.getcwd()

    def realpath(self, path: str) -> str:
        return os.path.realpath(os.path.join(self.cwd(), os.path.expanduser(path)))

    def read_file(self, path: str) -> str | None:
        try:
            return Path(path).read_text(errors="replace")
        except OSError:
            return None

    def listdir(self, path: str) -> list[str] | None:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return None

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def run(self, cmd: list[str]) -> CommandResult | None:
        """None when the tool is not installed; return code 124 when it ran past the timeout."""
        if shutil.which(cmd[0]) is None:
            return None
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.command_timeout_s)
        except subprocess.TimeoutExpired:
            return CommandResult(124, "", f"timed out after {self.command_timeout_s:g} s")
        except OSError as error:
            return CommandResult(127, "", str(error))
        return CommandResult(done.returncode, done.stdout, done.stderr)

    def disk_usage(self, path: str) -> DiskUsage | None:
        """Usage of the filesystem `path` will be on: its nearest existing parent's."""
        current = Path(self.realpath(path))
        while not current.exists() and current != current.parent:
            current = current.parent
        try:
            usage = shutil.disk_usage(current)
        except OSError:
            return None
        return DiskUsage(str(current), usage.total, usage.free)

    def rlimit(self, limit: Limit) -> tuple[int, int]:
        """(soft, hard); UNLIMITED for no limit."""
        soft, hard = resource.getrlimit(getattr(resource, f"RLIMIT_{limit.value.upper()}"))
        return tuple(UNLIMITED if v == resource.RLIM_INFINITY else v for v in (soft, hard))  # type: ignore[return-value]

    def package_version(self, dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def torch_info(self) -> TorchInfo:
        """torch's build from its version.py; devices and NCCL only for a GPU build (imports torch)."""
        if "torch" not in sys.modules:
            spec = importlib.util.find_spec("torch")
            if spec is None or spec.origin is None:
                return TorchInfo(version=None, error="torch is not installed")
            build = _read_torch_version_file(Path(spec.origin).parent / "version.py")
            if build is not None and build.cuda is None and build.hip is None:
                return build  # a CPU build: importing torch (seconds) would tell nothing more
        try:
            import torch
        except Exception as error:  # a broken install: report it, do not crash the doctor
            return TorchInfo(version=self.package_version("torch"), error=f"import torch: {error}")
        info = TorchInfo(version=torch.__version__, cuda=torch.version.cuda, hip=torch.version.hip)
        if info.cuda is None and info.hip is None:
            return info
        try:
            nccl = _nccl_version(torch)
            devices = [
                TorchDevice(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
                for i in range(torch.cuda.device_count())
            ]
        except Exception as error:
            return TorchInfo(info.version, info.cuda, info.hip, error=f"torch.cuda: {error}")
        return TorchInfo(info.version, info.cuda, info.hip, nccl=nccl, devices=devices)

    def resolve(self, host: str) -> list[str] | None:
        """Addresses of `host`, None when it does not resolve within 2 s."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = pool.submit(socket.getaddrinfo, host, None, 0, socket.SOCK_STREAM)
        try:
            infos = future.result(timeout=2.0)
        except (OSError, UnicodeError, concurrent.futures.TimeoutError):
            return None
        finally:
            pool.shutdown(wait=False)
        return sorted({str(info[4][0]) for info in infos})

    def port_is_free(self, host: str, port: int) -> bool:
        from dsv4rl.launcher.plan import port_is_free

        return port_is_free(host, port)

    def engine_interpreter(self, python: str) -> InterpreterInfo:
        """torch and sglang of the SGLang interpreter (runs it once; `import sglang` takes seconds)."""
        from dsv4rl.launcher.engine_python import probe_interpreter

        return probe_interpreter(python, timeout_s=120.0)

    def sandbox_facts(self, python: str | None) -> SandboxFacts | None:
        """What this node offers the python tool's sandbox for `python` (runs each layer once, ~1 s)."""
        from dsv4rl.tools.sandbox.probe import probe

        return probe(python or sys.executable)

    def time_collectives(self, world: int, backend: str, size_bytes: int, iters: int) -> dict[str, float]:
        """Seconds per all-reduce / broadcast across `world` local ranks (`dsv4rl doctor --probe`)."""
        from dsv4rl.doctor.collectives import run_ranks

        return run_ranks(world, backend, size_bytes, iters)

    def recipe_path_problems(self, cfg: Config) -> list[str]:
        """What `dsv4rl train` would refuse on this machine (model, tokenizer, data paths...)."""
        from dsv4rl.checks.validate import validate
        from dsv4rl.config.compose import ConfigError

        try:
            validate(cfg, check_paths=True)
        except ConfigError as error:
            return list(error.problems) or [str(error)]
        return []


def _read_torch_version_file(path: Path) -> TorchInfo | None:
    """`__version__`, `cuda` and `hip` of torch/version.py, read without importing torch."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    values: dict[str, Any] = {}
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and value is not None:
            try:
                values[target.id] = ast.literal_eval(value)
            except ValueError:
                continue
    if "__version__" not in values:
        return None
    return TorchInfo(version=str(values["__version__"]), cuda=values.get("cuda"), hip=values.get("hip"))


def _nccl_version(torch: Any) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version[:3])
    if isinstance(version, int):  # old torch: 21805 -> 2.18.5
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return str(version)


class RecordedProbe(SystemProbe):
    """A machine state recorded as JSON: what the checks would read on that node.

    Keys: hostname, python, cwd, env, files {path: text}, dirs {path: [names]}, commands {"cmd args":
    {returncode, stdout}}, disk_usage {path: {total, free}} (looked up at the path or its nearest listed
    parent), rlimits {memlock|nofile: [soft, hard]} (-1: unlimited), packages {dist: version}, torch
    (TorchInfo fields), resolve {host: [addresses]}, busy_ports [port...], engine_interpreters {python:
    InterpreterInfo fields}, recipe_path_problems [text...], collective_seconds {all_reduce, broadcast}
    (or {"error": text}: the collectives failed), sandbox (SandboxFacts fields; absent: not recorded).
    """

    def __init__(self, state: dict[str, Any], source: str = "<state>"):
        self.state = state
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> RecordedProbe:
        return cls(json.loads(Path(path).read_text()), str(path))

    def env(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self.state.get("env", {}).items()}

    def hostname(self) -> str:
        return str(self.state.get("hostname", "recorded-node"))

    def python_version(self) -> str:
        return str(self.state.get("python", "3.12.0"))

    def cwd(self) -> str:
        return str(self.state.get("cwd", "/"))

    def realpath(self, path: str) -> str:
        return os.path.normpath(os.path.join(self.cwd(), path))

    def read_file(self, path: str) -> str | None:
        return self.state.get("files", {}).get(path)

    def listdir(self, path: str) -> list[str] | None:
        names = self.state.get("dirs", {}).get(path)
        return None if names is None else sorted(names)

    def exists(self, path: str) -> bool:
        return path in self.state.get("files", {}) or path in self.state.get("dirs", {})

    def run(self, cmd: list[str]) -> CommandResult | None:
        recorded = self.state.get("commands", {}).get(" ".join(cmd))
        if recorded is None:
            return None
        return CommandResult(int(recorded.get("returncode", 0)), recorded.get("stdout", ""), "")

    def disk_usage(self, path: str) -> DiskUsage | None:
        table = self.state.get("disk_usage", {})
        current = self.realpath(path)
        while True:
            if current in table:
                return DiskUsage(current, int(table[current]["total"]), int(table[current]["free"]))
            if current == os.path.dirname(current):
                return None
            current = os.path.dirname(current)

    def rlimit(self, limit: Limit) -> tuple[int, int]:
        soft, hard = self.state.get("rlimits", {}).get(limit.value, [UNLIMITED, UNLIMITED])
        return int(soft), int(hard)

    def package_version(self, dist: str) -> str | None:
        return self.state.get("packages", {}).get(dist)

    def torch_info(self) -> TorchInfo:
        data = dict(self.state.get("torch", {"version": None, "error": "torch is not installed"}))
        data["devices"] = [TorchDevice(**d) for d in data.get("devices", [])]
        return TorchInfo(**data)

    def resolve(self, host: str) -> list[str] | None:
        return self.state.get("resolve", {}).get(host)

    def port_is_free(self, host: str, port: int) -> bool:
        return port not in self.state.get("busy_ports", [])

    def engine_interpreter(self, python: str) -> InterpreterInfo:
        recorded = self.state.get("engine_interpreters", {}).get(python)
        if recorded is None:
            return InterpreterInfo(python, failure="no such file")
        return InterpreterInfo(python, **recorded)

    def recipe_path_problems(self, cfg: Config) -> list[str]:
        return list(self.state.get("recipe_path_problems", []))

    def sandbox_facts(self, python: str | None) -> SandboxFacts | None:
        recorded = self.state.get("sandbox")
        return None if recorded is None else SandboxFacts(**recorded)

    def time_collectives(self, world: int, backend: str, size_bytes: int, iters: int) -> dict[str, float]:
        recorded = self.state.get("collective_seconds")
        if recorded is None or "error" in recorded:
            raise RuntimeError(recorded["error"] if recorded else f"{self.source} records no collectives")
        return {str(k): float(v) for k, v in recorded.items()}
