"""Network and storage: the master address, the ports this node will listen on, proxies in the way of
the engines' HTTP, and the run directory (space, and a shared filesystem for multi-node runs).

httpx, which the rollout client uses, honours http(s)_proxy and no_proxy from the environment; torch's
TCPStore and NCCL bootstrap do not, so a proxy only breaks the HTTP to the engines.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import Config
from dsv4rl.doctor.context import NO_RECIPE, Context
from dsv4rl.doctor.verdict import Check, Status
from dsv4rl.launcher.plan import engine_urls, planned_ports

GIB = 2**30
MIN_FREE_FAIL = 1 * GIB
MIN_FREE_WARN = 20 * GIB  # configs, logs, metrics; checkpoints of a full-size model need far more
PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
SHARED_FS = (
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
    "fuse.cephfs", "fuse.beegfs", "wekafs", "fuse.weka", "cifs", "smb3", "9p", "virtiofs", "fuse.juicefs",
)  # fmt: skip


def check_master_addr(ctx: Context) -> Check:
    if ctx.cfg is None:
        host = ctx.facts.env.get("MASTER_ADDR")
        if not host:
            return Check("network.master_addr", Status.SKIP, f"MASTER_ADDR unset; {NO_RECIPE}")
        where = "MASTER_ADDR"
    else:
        host, where = ctx.cfg.cluster.master_addr, "cluster.master_addr"
    addresses = ctx.probe.resolve(host)
    if not addresses:
        return Check(
            "network.master_addr",
            Status.FAIL,
            f"{where}={host} does not resolve",
            "use node 0's IP or fix DNS (Slurm: MASTER_ADDR=$(scontrol show hostnames | head -n1))",
        )
    return Check("network.master_addr", Status.PASS, f"{where}={host} -> {', '.join(addresses)}")


def check_ports(ctx: Context) -> Check:
    cfg = ctx.cfg if ctx.cfg is not None else Config()
    suffix = "" if ctx.cfg is not None else " (dsv4rl's default ports; pass recipe=NAME for the recipe's)"
    ports = planned_ports(cfg)
    if not ports:
        return Check("network.ports", Status.PASS, f"node {cfg.cluster.node_rank} listens on no port{suffix}")
    busy = [p for p in ports if not ctx.probe.port_is_free(p.host, p.port)]
    listing = ", ".join(f"{p.port} ({p.what})" for p in ports)
    if busy:
        first = busy[0]
        return Check(
            "network.ports",
            Status.FAIL,
            "in use: " + ", ".join(f"{p.port} ({p.what}, {p.key})" for p in busy) + suffix,
            f"stop what listens (`ss -ltnp 'sport = :{first.port}'`) or move it: {first.key}=<another port>",
        )
    return Check("network.ports", Status.PASS, f"free: {listing}{suffix}")


def _bypassed(host: str, no_proxy: list[str]) -> bool:
    """Does a no_proxy list (hosts, .domains, *.domains, CIDRs, '*') exempt `host`?"""
    host = host.strip("[]").lower()
    for entry in no_proxy:
        entry = entry.lower().removeprefix("*")
        if entry == "":
            return True  # "*"
        if host == entry.lstrip(".") or host.endswith("." + entry.lstrip(".")):
            return True
        try:
            if ipaddress.ip_address(host) in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _hosts_to_exempt(ctx: Context) -> list[str]:
    """The master address and every engine's host (engine URLs as the trainer builds them)."""
    if ctx.cfg is None:
        hosts = ["127.0.0.1"]
        if ctx.facts.env.get("MASTER_ADDR"):
            hosts.append(ctx.facts.env["MASTER_ADDR"])
        return hosts
    hosts = [ctx.cfg.cluster.master_addr]
    try:
        hosts += [urlsplit(url).hostname or "" for url in engine_urls(ctx.cfg)]
    except ConfigError:
        hosts += list(ctx.cfg.cluster.node_addrs)
    return list(dict.fromkeys(h for h in hosts if h))


def check_proxy(ctx: Context) -> Check:
    env = ctx.process_env()
    proxies = [k for k in PROXY_VARS if env.get(k)]
    if not proxies:
        return Check("network.proxy", Status.PASS, "no http(s)_proxy set")
    no_proxy = [e.strip() for e in (env.get("no_proxy") or env.get("NO_PROXY") or "").split(",") if e.strip()]
    hosts = _hosts_to_exempt(ctx)
    uncovered = [h for h in hosts if not _bypassed(h, no_proxy)]
    shown = ", ".join(proxies)
    if uncovered:
        return Check(
            "network.proxy",
            Status.FAIL,
            f"{shown} set and no_proxy does not cover {', '.join(uncovered)}: the trainer's HTTP to the "
            "engines would go through the proxy",
            f"export no_proxy=$no_proxy,{','.join(uncovered)},localhost (and NO_PROXY likewise)",
        )
    return Check("network.proxy", Status.PASS, f"{shown} set; no_proxy covers {', '.join(hosts)}")


def _run_dir(ctx: Context) -> str | None:
    return None if ctx.cfg is None else ctx.cfg.run.dir


def check_run_dir_space(ctx: Context) -> Check:
    run_dir = _run_dir(ctx)
    if run_dir is None:
        return Check("storage.run_dir", Status.SKIP, NO_RECIPE)
    usage = ctx.probe.disk_usage(run_dir)
    if usage is None:
        return Check("storage.run_dir", Status.FAIL, f"run.dir={run_dir}: no filesystem found", "create it")
    detail = (
        f"run.dir={run_dir} (on {usage.path}): {usage.free / GIB:.1f} GiB free of {usage.total / GIB:.1f}"
    )
    if usage.free < MIN_FREE_FAIL:
        status = Status.FAIL
    elif usage.free < MIN_FREE_WARN:
        status = Status.WARN
    else:
        return Check("storage.run_dir", Status.PASS, detail)
    return Check(
        "storage.run_dir",
        status,
        f"{detail}: logs and checkpoints need room",
        "free space there or point run.dir=<a larger filesystem>",
    )


def mount_of(path: str, mounts_text: str) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the longest mount point that contains `path` (/proc/mounts)."""
    best: tuple[str, str] | None = None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) > len(best[0])):
            best = (point, fields[2])
    return best


def check_shared_fs(ctx: Context) -> Check:
    run_dir = _run_dir(ctx)
    if run_dir is None:
        return Check("storage.shared_fs", Status.SKIP, NO_RECIPE)
    if not ctx.multi_node:
        return Check("storage.shared_fs", Status.SKIP, "one node: run.dir need not be shared")
    mounts = ctx.probe.read_file("/proc/mounts")
    found = mount_of(ctx.probe.realpath(run_dir), mounts) if mounts else None
    if found is None:
        return Check("storage.shared_fs", Status.SKIP, "/proc/mounts is not readable")
    point, fstype = found
    detail = f"run.dir={run_dir} is on {point} ({fstype})"
    if fstype in SHARED_FS:
        return Check("storage.shared_fs", Status.PASS, f"{detail}: shared")
    return Check(
        "storage.shared_fs",
        Status.FAIL,
        f"{detail}, a local filesystem, but the recipe's nodes share run.dir (configs, logs, engine keys, "
        "checkpoints)",
        "point run.dir at a filesystem every node mounts at the same path (NFS, Lustre, GPFS, ...)",
    )


def check_recipe_paths(ctx: Context) -> Check:
    if ctx.cfg is None:
        return Check("recipe.paths", Status.SKIP, NO_RECIPE)
    problems = ctx.probe.recipe_path_problems(ctx.cfg)
    if problems:
        return Check(
            "recipe.paths",
            Status.FAIL,
            "`dsv4rl train` here would stop: " + "; ".join(problems),
            "fix the paths named (model.path, data.path, ...) on this node",
        )
    return Check("recipe.paths", Status.PASS, "model, tokenizer and data paths are usable here")


CHECKS = (
    check_recipe_paths,
    check_master_addr,
    check_ports,
    check_proxy,
    check_run_dir_space,
    check_shared_fs,
)
