"""A cgroup per sandboxed call: `memory_mb` and `max_processes` over all of the call's processes together,
and one place to kill them all.

RLIMIT_AS bounds one process; six children of one call each get their own. A cgroup's memory limit counts
every page of every process in it (tmpfs pages they write included), and its pids limit every task.

Where the groups go (`find_parent`, once per process):
- cgroup v1 with the memory and pids controllers mounted (as on many CI machines and older clusters): a
  group beneath this process's own group in each of the two hierarchies, so the sandbox's memory still
  counts toward the job's own limit.
- cgroup v2: beneath `$DSV4RL_SANDBOX_CGROUP` when set (a directory delegated to this user with the
  memory and pids controllers enabled in its subtree, e.g. systemd's `Delegate=yes`), else beneath the
  root of the hierarchy when this process lives there. A v2 group that holds processes cannot enable
  controllers for children, so a process in an ordinary leaf (a Slurm step, a container) gets none.
Creating groups needs write access (root, or a delegated tree); without it the sandbox plans without a
cgroup and says so (tools/sandbox/isolation.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV_PARENT = "DSV4RL_SANDBOX_CGROUP"
_names = itertools.count()


@dataclass(frozen=True)
class CgroupParent:
    """Where the call groups are made: v1, one directory per controller; v2, one directory."""

    version: int
    dirs: tuple[Path, ...]  # v1: (memory, pids); v2: (unified,)

    def describe(self) -> str:
        return f"cgroup v{self.version} ({', '.join(str(d) for d in self.dirs)})"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, filesystem type, super options) of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, _source, options = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((left.split()[4], fstype, set(options.split(","))))
    return found


def _own_groups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's group path, from /proc/self/cgroup."""
    groups = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                groups[name] = path
    return groups


def _usable(parent: CgroupParent) -> str | None:
    """None when a call group can be made, limited and removed beneath `parent`; else why not."""
    probe = CallCgroup(parent, memory_mb=64, max_processes=8, name=f"dsv4rl-probe-{os.getpid()}")
    try:
        probe.create()
    except OSError as error:
        return f"cannot create a group beneath {parent.describe()}: {error.strerror or error}"
    finally:
        probe.remove()
    return None


@functools.cache
def find_parent() -> tuple[CgroupParent | None, str]:
    """The parent for call groups on this machine, or None and the reason (for validation's message);
    measured once per process."""
    try:
        mounts, own = _mounts(), _own_groups()
    except OSError as error:
        return None, f"cannot read this process's cgroups: {error}"
    v1 = {}
    for point, fstype, options in mounts:
        for controller in ("memory", "pids"):
            if fstype == "cgroup" and controller in options and controller in own:
                v1[controller] = Path(point) / own[controller].lstrip("/")
    if len(v1) == 2:
        parent = CgroupParent(1, (v1["memory"], v1["pids"]))
        why = _usable(parent)
        return (parent, "") if why is None else (None, why)
    explicit = os.environ.get(ENV_PARENT)
    unified = next((point for point, fstype, _ in mounts if fstype == "cgroup2"), None)
    if explicit:
        parent = CgroupParent(2, (Path(explicit),))
    elif unified and own.get("") == "/":
        parent = CgroupParent(2, (Path(unified) / "dsv4rl-sandbox",))
        with contextlib.suppress(OSError):
            parent.dirs[0].mkdir(exist_ok=True)
            _enable_controllers(Path(unified))
            _enable_controllers(parent.dirs[0])
    elif unified:
        return None, (
            f"cgroup v2 only, and this process's group {own.get('')} holds processes, so it "
            f"cannot have limited children: set {ENV_PARENT} to a delegated group with the "
            "memory and pids controllers"
        )
    else:
        return None, "no cgroup v2, and no cgroup v1 with both the memory and pids controllers"
    why = _usable(parent)
    return (parent, "") if why is None else (None, why)


def _enable_controllers(group: Path) -> None:
    enabled = (group / "cgroup.subtree_control").read_text().split()
    wanted = [f"+{c}" for c in ("memory", "pids") if c not in enabled]
    if wanted:
        (group / "cgroup.subtree_control").write_text(" ".join(wanted))


class CallCgroup:
    """One call's group: created before the code runs, the runner moved in, killed and removed after."""

    def __init__(self, parent: CgroupParent, memory_mb: int, max_processes: int, name: str | None = None):
        self.parent = parent
        self.name = name or f"dsv4rl-py-{os.getpid()}-{next(_names)}"
        self.dirs = tuple(d / self.name for d in parent.dirs)
        self.memory_bytes = int(memory_mb) << 20
        self.max_processes = int(max_processes)

    def create(self) -> None:
        for d in self.dirs:
            d.mkdir()
        if self.parent.version == 1:
            memory, pids = self.dirs
            (memory / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
            swap = memory / "memory.memsw.limit_in_bytes"  # no swap beyond the limit, where accounted
            if swap.exists():
                swap.write_text(str(self.memory_bytes))
            (pids / "pids.max").write_text(str(self.max_processes))
        else:
            (group,) = self.dirs
            (group / "memory.max").write_text(str(self.memory_bytes))
            swap = group / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            (group / "pids.max").write_text(str(self.max_processes))

    def add(self, pid: int) -> None:
        """Move `pid` (the runner, before it forks anything) into the group."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return found

    def memory_exceeded(self) -> bool:
        """The limit was hit: the kernel's OOM killer ran in the group (or an allocation failed)."""
        memory = self.dirs[0]
        with contextlib.suppress(OSError, ValueError):
            if self.parent.version == 1:
                oom = dict(line.split() for line in (memory / "memory.oom_control").read_text().splitlines())
                return int(oom.get("oom_kill", 0)) > 0 or int((memory / "memory.failcnt").read_text()) > 0
            events = dict(line.split() for line in (memory / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0)) > 0 or int(events.get("max", 0)) > 0
        return False

    def kill(self) -> None:
        """SIGKILL every process in the group until it is empty (cgroup.kill where the kernel has it)."""
        killer = self.dirs[0] / "cgroup.kill"
        if self.parent.version == 2 and killer.exists():
            with contextlib.suppress(OSError):
                killer.write_text("1")
        for _ in range(500):
            left = self.pids()
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.004)

    def remove(self) -> None:
        """Kill what is left and remove the group (a group empties once its processes are reaped)."""
        self.kill()
        for d in self.dirs:
            for _ in range(250):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.004)
