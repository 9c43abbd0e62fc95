"""The python tool's sandbox on this node: which isolation each mode would get, and whether the recipe's
python tools can run here as configured (tools run on node 0, next to trainer rank 0).

The same planning as validation (dsv4rl.tools.sandbox.isolation), from the same probe: what doctor says
here is what `dsv4rl train` will do.
"""

from __future__ import annotations

from typing import Any

from dsv4rl.config.choices import RolloutMode, SandboxIsolation
from dsv4rl.doctor.context import Context
from dsv4rl.doctor.verdict import Check, Status
from dsv4rl.tools.sandbox.isolation import FIXES, IsolationUnavailable, SandboxFacts, plan_isolation

NAME = "sandbox.python_tool"


def _offers(facts: SandboxFacts) -> str:
    """One line: what each layer of this node does."""
    landlock = f"Landlock ABI {facts.landlock_abi}" if facts.landlock_abi else "no Landlock"
    parts = [
        "namespaces " + ("work" if facts.namespaces else f"fail ({facts.namespaces_error[:160]})"),
        landlock + (", landlock mode works" if facts.landlock_works else f" ({facts.landlock_error[:160]})"),
        "seccomp " + ("works" if facts.seccomp else f"unavailable ({facts.seccomp_error[:120]})"),
        facts.cgroup or f"no cgroup for the calls ({facts.cgroup_error[:160]})",
        "root (a uid per trajectory)" if facts.root else "not root",
    ]
    return "; ".join(parts)


def _python_entries(ctx: Context) -> list[dict[str, Any]]:
    cfg = ctx.cfg
    if cfg is None or cfg.rollout.mode != RolloutMode.tools:
        return []
    return [dict(t.kwargs) for t in cfg.rollout.tools if t.target == "builtin:python"]


def check_python_tool(ctx: Context) -> Check:
    entries = _python_entries(ctx)
    if ctx.cfg is not None and not entries:
        return Check(NAME, Status.PASS, "the recipe runs no python tool (builtin:python): nothing to isolate")
    if ctx.cfg is not None and entries and ctx.cfg.cluster.node_rank != 0:
        rank = ctx.cfg.cluster.node_rank
        return Check(NAME, Status.SKIP, f"the recipe's tools run on node 0; this is node {rank}")
    pythons = {kwargs.get("python") for kwargs in entries} or {None}
    verdicts = []
    for python in sorted(pythons, key=str):
        facts = ctx.probe.sandbox_facts(python)
        if facts is None:
            return Check(NAME, Status.SKIP, "the sandbox's layers were not probed on this node")
        offers = f"{_offers(facts)} (python {python or 'this interpreter'})"
        mine = [k for k in entries if k.get("python") == python] or [{}]
        for kwargs in mine:
            isolation = str(kwargs.get("isolation", SandboxIsolation.auto))
            if isolation == SandboxIsolation.remote:
                verdicts.append(
                    (
                        Status.PASS,
                        f"isolation remote: {kwargs.get('remote', {}).get('url')} "
                        "isolates (checked with a test run at validation)",
                        "",
                    )
                )
                continue
            try:
                plan = plan_isolation(
                    facts,
                    isolation,
                    bool(kwargs.get("trust_model_code", False)),
                    int(kwargs.get("max_processes", 64)),
                )
            except IsolationUnavailable as error:
                status = Status.FAIL if entries else Status.WARN
                verdicts.append((status, f"{error} [{offers}]", "; ".join(FIXES)))
                continue
            what = "the recipe's python tool" if entries else "isolation auto"
            verdicts.append((Status.PASS, f"{what} gets {plan.describe()}", ""))
    worst = max(verdicts, key=lambda v: [Status.PASS, Status.WARN, Status.FAIL].index(v[0]))
    detail = " | ".join(v[1] for v in verdicts)
    return Check(NAME, worst[0], detail, worst[2])


CHECKS = (check_python_tool,)
