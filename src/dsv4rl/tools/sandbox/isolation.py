"""Which isolation the `python` tool gets: the guarantees, the layer that gives each on this node, and a
refusal naming what is missing and the fixes when a mode cannot give them all. Pure: the facts come from
tools/sandbox/probe.py, so every branch is tested with made-up facts, and the decision is made once, at
validation, never per call.

The guarantees (every local mode but `rlimits`, which promises only the last three, and only with
`trust_model_code: true`): the model's code cannot
- files:      read files outside its scratch directory and the interpreter's read-only tree, or write
              outside the scratch directory;
- network:    open any socket to anything, loopback included;
- processes:  see, signal or trace other processes (the trainer, the engines), or read their /proc
              entries (their environment holds the run's secrets);
- privileges: hold any capability or gain one (setuid programs);
- cleanup:    outlive its call: every process it started, setsid or not, is killed and reaped before
              the result returns;
- memory:     use more than `memory_mb` over all its processes together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4rl.config.choices import SandboxIsolation

GUARANTEES = ("files", "network", "processes", "privileges", "cleanup", "memory")
LANDLOCK_MIN_ABI = 3  # ABI 3 (Linux 6.2) is the first that also refuses truncating files outside the tree
LANDLOCK_SCOPE_ABI = 6  # ABI 6 (Linux 6.12): signals and abstract unix sockets scoped to the domain
FIXES = (
    (
        "enable unprivileged user namespaces (Ubuntu 24.04: "
        "sysctl kernel.apparmor_restrict_unprivileged_userns=0; Debian before 11: "
        "sysctl kernel.unprivileged_userns_clone=1), or run the trainer as root with CAP_SYS_ADMIN "
        "(a container with --cap-add SYS_ADMIN and a seccomp profile that allows unshare)"
    ),
    "isolation: landlock, on Linux 6.2+ with libseccomp (pip install pyseccomp; the libseccomp2 package)",
    "isolation: remote with a SandboxFusion service (remote: {url: http://sandbox-host:8080/run_code})",
    "isolation: rlimits with trust_model_code: true, only for code you would run yourself",
)


class IsolationUnavailable(RuntimeError):
    """The requested isolation cannot be given on this node; the message names what is missing and the
    fixes (validation reports it before any process starts)."""


@dataclass(frozen=True)
class SandboxFacts:
    """What this node offers the sandbox (tools/sandbox/probe.py measures it)."""

    root: bool
    namespaces: bool  # unshare's net, mount and pid namespaces and the new root worked end to end
    namespaces_error: str = ""
    landlock_abi: int = 0  # 0: no Landlock
    seccomp: bool = False  # libseccomp compiled the filter and the kernel loads seccomp filters
    seccomp_error: str = ""
    landlock_works: bool = False  # the landlock mode ran a program end to end with this interpreter
    landlock_error: str = ""
    rlimits_works: bool = False  # the rlimits mode ran a program end to end with this interpreter
    rlimits_error: str = ""
    cgroup: str | None = None  # the call groups' parent, described; None: no cgroup for the calls
    cgroup_error: str = ""


@dataclass(frozen=True)
class IsolationPlan:
    """The mode that runs, the layer behind each guarantee, and the limits as enforced."""

    mode: SandboxIsolation
    layers: dict[str, str]
    max_processes: int
    use_cgroup: bool
    use_seccomp: bool
    allow_fork: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        layers = "; ".join(f"{g}: {self.layers[g]}" for g in GUARANTEES if g in self.layers)
        return f"{self.mode} ({layers})" + "".join(f"; {n}" for n in self.notes)


def _memory_layer(facts: SandboxFacts, max_processes: int, own_uid: bool) -> tuple[str, int, bool, str]:
    """(layer, max_processes as enforced, allow_fork, note) for the memory guarantee; '' layer: none."""
    if facts.cgroup:
        return f"cgroup memory and pids limits per call ({facts.cgroup})", max_processes, True, ""
    note = (
        f"max_processes forced from {max_processes} to 1 (no cgroup for the calls: "
        f"{facts.cgroup_error or 'none found'}), so that memory_mb bounds the call"
    )
    if own_uid:
        return "one process (RLIMIT_NPROC=1 for the call's own uid) under RLIMIT_AS", 1, False, note
    if facts.seccomp:
        return "one process (seccomp refuses fork) under RLIMIT_AS", 1, False, note
    return "", max_processes, True, ""


def _local_plan(
    facts: SandboxFacts, mode: SandboxIsolation, max_processes: int
) -> tuple[IsolationPlan, list]:
    """The plan for a local mode, and what it lacks (empty: every guarantee holds)."""
    own_uid = facts.root  # as root each trajectory runs under a uid of its own
    missing: list[str] = []
    layers = {"privileges": "no capabilities, no_new_privs" + (", a uid of its own" if own_uid else "")}
    if mode == SandboxIsolation.namespaces:
        if not facts.namespaces:
            missing.append(f"namespaces do not work here ({facts.namespaces_error or 'unshare failed'})")
        layers |= {
            "files": "mount namespace: a read-only minimal root, the scratch directory writable",
            "network": "network namespace without interfaces"
            + (", and the seccomp filter" if facts.seccomp else ""),
            "processes": "pid namespace" + (" and a uid of its own" if own_uid else " in a user namespace"),
            "cleanup": "pid namespace (its init's exit kills every process)",
        }
    elif mode == SandboxIsolation.landlock:
        if facts.landlock_abi < LANDLOCK_MIN_ABI:
            missing.append(
                f"Landlock ABI {LANDLOCK_MIN_ABI}+ (Linux 6.2+); this kernel has "
                + (f"ABI {facts.landlock_abi}" if facts.landlock_abi else "no Landlock")
            )
        if not facts.seccomp:
            missing.append(f"seccomp for the network ({facts.seccomp_error or 'unavailable'})")
        if not own_uid and facts.landlock_abi < LANDLOCK_SCOPE_ABI:
            missing.append(
                f"a uid of its own (run as root) or Landlock ABI {LANDLOCK_SCOPE_ABI}+ (Linux "
                "6.12+) to keep signals from the trainer"
            )
        if not missing and not facts.landlock_works:
            missing.append(f"the landlock mode failed its trial run: {facts.landlock_error}")
        layers |= {
            "files": "Landlock: read only the system and interpreter trees, write only the scratch directory",
            "network": "seccomp: socket() refused for every family"
            + (", Landlock: no TCP" if facts.landlock_abi >= 4 else ""),
            "processes": ("a uid of its own, " if own_uid else "Landlock signal scoping, ")
            + "Landlock ptrace scoping, no /proc access",
            "cleanup": "a subreaper outside the sandbox kills every descendant"
            + (" and every process of the call's uid" if own_uid else ""),
        }
    else:  # rlimits: trusted code
        if not facts.rlimits_works:
            missing.append(f"the rlimits mode failed its trial run: {facts.rlimits_error}")
        layers |= {
            "files": "not isolated (" + ("a uid of its own: file permissions" if own_uid else "none") + ")",
            "network": "not isolated",
            "processes": "a uid of its own" if own_uid else "not isolated",
            "cleanup": "a subreaper kills every descendant"
            + (" and every process of the call's uid" if own_uid else ""),
        }
    memory, enforced, allow_fork, note = _memory_layer(facts, max_processes, own_uid)
    if not memory:
        missing.append(
            "a bound on memory over all processes of a call: a writable cgroup (v1 memory+pids, "
            "or a delegated v2 group), or root or seccomp to hold a call to one process"
        )
    layers["memory"] = memory or "per process only"
    if facts.cgroup:
        layers["cleanup"] += ", and the call's cgroup is emptied"
    # seccomp everywhere it works, as a second wall; in rlimits only where it holds the call to one process
    seccomp = facts.seccomp and (mode != SandboxIsolation.rlimits or (not allow_fork and not own_uid))
    if seccomp and mode == SandboxIsolation.rlimits:
        layers["network"] = "refused by the seccomp filter that holds the call to one process"
    plan = IsolationPlan(
        mode, layers, enforced, bool(facts.cgroup), seccomp, allow_fork, (note,) if note else ()
    )
    return plan, missing


def remote_plan(url: str) -> IsolationPlan:
    """The remote mode: every guarantee is the service's; this node runs nothing of the model's."""
    service = f"the sandbox service's own isolation ({url})"
    layers = {g: service for g in GUARANTEES} | {
        "cleanup": "the service ends each run (a fresh directory per request)",
        "memory": f"the service's memory_limit_MB per run ({url})",
    }
    return IsolationPlan(
        SandboxIsolation.remote, layers, 1, False, False, True, ("files do not persist between calls",)
    )


def plan_isolation(
    facts: SandboxFacts, requested: str, trust_model_code: bool, max_processes: int
) -> IsolationPlan:
    """The plan for `requested` (auto: the strongest that gives every guarantee); IsolationUnavailable,
    naming what is missing and the fixes, where none does. `remote` is planned by the remote client."""
    requested = SandboxIsolation(requested)
    fixes = "; ".join(FIXES)
    if requested == SandboxIsolation.rlimits:
        if not trust_model_code:
            raise IsolationUnavailable(
                "python tool: isolation=rlimits gives the model's code no file, network or process "
                "isolation; "
                "use isolation auto, namespaces, landlock or remote, or set trust_model_code: true to "
                "accept that (only for code you would run yourself)"
            )
        plan, missing = _local_plan(facts, requested, max_processes)
        if missing:
            raise IsolationUnavailable(f"python tool: isolation=rlimits: {'; '.join(missing)}")
        return plan
    if requested == SandboxIsolation.remote:
        raise ValueError("the remote mode is planned by its client, not from this node's facts")
    modes = (
        [SandboxIsolation.namespaces, SandboxIsolation.landlock]
        if requested == SandboxIsolation.auto
        else [requested]
    )
    refusals = []
    for mode in modes:
        plan, missing = _local_plan(facts, mode, max_processes)
        if not missing:
            return plan
        refusals.append(f"{mode}: " + "; ".join(missing))
    raise IsolationUnavailable(
        f"python tool: isolation={requested} cannot isolate the model's code on this node ("
        + " | ".join(refusals)
        + f"). Fixes: {fixes}. `dsv4rl doctor` shows what this node offers."
    )
