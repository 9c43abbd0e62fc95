"""The process environment against the recipe: its comm preset, stale and conflicting variables, socket
interfaces, and SGLang's DeepSeek-V4 variables.

The planner gives every process this shell's environment with `comm.env` over it, and SGLang engines
`quant.engine_env` over that (`dsv4rl.launcher.plan`, `dsv4rl.quant.sglang_env.engine_env`); these checks
judge the same merged environments. Facts: MSCCL/MSCCL++ left RCCL in ROCm 7.13 (RCCL release notes), so
their switches do nothing there; the ROCr runtime applies ROCR_VISIBLE_DEVICES first and HIP's
HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES index into what is left (ROCm docs, "GPU isolation"); XNACK
(retry on page fault) is for APUs and unified memory, and costs a discrete MI300X/MI355X throughput;
NCCL_SOCKET_IFNAME takes interface-name prefixes, `=` for an exact name, `^` to exclude (NCCL docs).
"""

from __future__ import annotations

from dsv4rl.config.choices import RolloutEngineKind
from dsv4rl.doctor.context import NO_RECIPE, Context
from dsv4rl.doctor.facts import DISCRETE_AMD, GpuModel, GpuVendor, version_tuple
from dsv4rl.doctor.verdict import Check, Status
from dsv4rl.quant import sglang_env
from dsv4rl.quant.sglang_env import engine_env

MSCCL_REMOVED_IN = (7, 13)  # ROCm release whose RCCL no longer has MSCCL / MSCCL++
VISIBILITY = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
SOCKET_IFNAMES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
NET_CLASS = "/sys/class/net"
RELEASED_CHECKPOINT_EXPERTS = sglang_env.MXFP4  # DeepSeek-V4's released checkpoints store MXFP4 experts


def _is_msccl(name: str) -> bool:
    return name == "RCCL_MSCCL_ENABLE" or name.startswith(("RCCL_MSCCL_", "RCCL_MSCCLPP_"))


def _show(names: list[str], env: dict[str, str]) -> str:
    return ", ".join(f"{n}={env[n]}" for n in names)


def check_comm_preset(ctx: Context) -> Check:
    if ctx.cfg is None:
        return Check("env.comm_preset", Status.SKIP, NO_RECIPE)
    preset, shell = ctx.recipe_env(), ctx.facts.env
    name = ctx.cfg.comm.name
    if not preset:
        return Check("env.comm_preset", Status.PASS, f"comm={name} sets no variables")
    different = sorted(k for k, v in preset.items() if k in shell and shell[k] != v)
    missing = sorted(k for k in preset if k not in shell)
    same = len(preset) - len(missing) - len(different)
    detail = f"comm={name} sets {len(preset)} variables, {same} exported here with the same value"
    if missing:
        detail += f"; not exported here (dsv4rl sets them for its processes): {', '.join(missing)}"
    if different:
        shown = ", ".join(f"{k}={shell[k]} (recipe: {preset[k]})" for k in different)
        return Check(
            "env.comm_preset",
            Status.WARN,
            f"{detail}; different here: {shown}. dsv4rl's processes get the recipe's values, tools started "
            "from this shell (rccl-tests, a hand-started SGLang) get these",
            "unset them or export the recipe's values; to keep yours, pass +comm.env.NAME=VALUE",
        )
    return Check("env.comm_preset", Status.PASS, detail)


def check_stale_rccl(ctx: Context) -> Check:
    env = ctx.process_env()
    stale = sorted(k for k in env if _is_msccl(k))
    if ctx.facts.vendor is not GpuVendor.amd:
        return Check("env.stale_rccl", Status.SKIP, "no AMD GPU (RCCL-only variables)")
    if not stale:
        return Check("env.stale_rccl", Status.PASS, "no MSCCL/MSCCL++ variables")
    rocm = version_tuple(ctx.facts.rocm_version)
    if rocm is None:
        return Check("env.stale_rccl", Status.SKIP, f"{_show(stale, env)} set; the ROCm version is unknown")
    if rocm[:2] < MSCCL_REMOVED_IN:
        return Check(
            "env.stale_rccl", Status.PASS, f"{_show(stale, env)} (MSCCL still exists in ROCm {rocm})"
        )
    where = "comm.env" if any(k in ctx.recipe_env() for k in stale) else "the environment"
    return Check(
        "env.stale_rccl",
        Status.WARN,
        f"{_show(stale, env)} on ROCm {ctx.facts.rocm_version}: MSCCL/MSCCL++ were removed from RCCL in "
        f"ROCm {'.'.join(map(str, MSCCL_REMOVED_IN))}: the setting does nothing and misleads its readers",
        f"unset {' '.join(stale)} (remove from {where}; it was copied from an older launcher)",
    )


def _device_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def check_visible_devices(ctx: Context) -> Check:
    env = ctx.process_env()
    masks = {k: env[k] for k in VISIBILITY if k in env}
    if not masks:
        return Check("env.visible_devices", Status.PASS, "no visibility mask set (every GPU visible)")
    shown = ", ".join(f"{k}={v}" for k, v in masks.items())
    hip, cuda, rocr = (
        masks.get(k) for k in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    )
    if ctx.facts.vendor is GpuVendor.amd:
        if hip is not None and cuda is not None and _device_list(hip) != _device_list(cuda):
            return Check(
                "env.visible_devices",
                Status.FAIL,
                f"{shown}: HIP and CUDA masks disagree; the HIP runtime and tools that read "
                "CUDA_VISIBLE_DEVICES (dsv4rl's trainer placement, SGLang, Ray) pick different GPUs",
                "unset HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES (dsv4rl assigns GPUs itself), or make "
                "them equal",
            )
        inner = hip if hip is not None else cuda
        if rocr is not None and inner is not None:
            size = len(_device_list(rocr))
            beyond = [d for d in _device_list(inner) if d.isdigit() and int(d) >= size]
            if beyond:
                return Check(
                    "env.visible_devices",
                    Status.FAIL,
                    f"{shown}: HIP indexes into the {size} GPU(s) ROCR_VISIBLE_DEVICES leaves, so "
                    f"{', '.join(beyond)} do not exist ('no ROCm-capable device')",
                    "set only one mask (unset ROCR_VISIBLE_DEVICES)",
                )
            return Check(
                "env.visible_devices",
                Status.WARN,
                f"{shown}: two levels of masks (HIP indices are relative to ROCR's list), easy to get wrong",
                "set only one mask (unset ROCR_VISIBLE_DEVICES)",
            )
    elif ctx.facts.vendor is GpuVendor.nvidia and (hip is not None or rocr is not None):
        return Check(
            "env.visible_devices",
            Status.WARN,
            f"{shown}: HIP/ROCR masks mean nothing to CUDA but confuse tools that read them",
            "unset HIP_VISIBLE_DEVICES and ROCR_VISIBLE_DEVICES on NVIDIA nodes",
        )
    return Check("env.visible_devices", Status.PASS, shown)


def check_xnack(ctx: Context) -> Check:
    value = ctx.process_env().get("HSA_XNACK")
    if ctx.facts.vendor is not GpuVendor.amd:
        return Check("env.hsa_xnack", Status.SKIP, "no AMD GPU")
    if value != "1":
        return Check("env.hsa_xnack", Status.PASS, f"HSA_XNACK={value}" if value else "HSA_XNACK unset")
    if ctx.facts.model is GpuModel.MI300A:
        return Check("env.hsa_xnack", Status.PASS, "HSA_XNACK=1 on an MI300A (APU): expected")
    model = ctx.facts.model.value if ctx.facts.model in DISCRETE_AMD else f"{ctx.facts.arch} GPU"  # type: ignore[union-attr]
    return Check(
        "env.hsa_xnack",
        Status.WARN,
        f"HSA_XNACK=1 on a discrete {model}: page-fault retry is meant for APUs and unified memory; here it "
        "costs throughput, and code objects built for xnack- will not load",
        "unset HSA_XNACK (launchers written for APUs set it; do not copy it)",
    )


def _matches(spec: str, interfaces: list[str]) -> tuple[bool, str]:
    """Does NCCL's interface spec select an existing interface? ('eth', '=eth0', '^docker,lo')."""
    spec = spec.strip()
    if spec.startswith("^"):
        excluded = [p for p in spec[1:].split(",") if p]
        left = [i for i in interfaces if not any(i.startswith(p.lstrip("=")) for p in excluded)]
        return bool(left), ", ".join(left)
    exact = spec.startswith("=")
    parts = [p for p in spec.lstrip("=").split(",") if p]
    hits = [i for i in interfaces if any((i == p if exact else i.startswith(p)) for p in parts)]
    return bool(hits), ", ".join(hits)


def check_socket_ifname(ctx: Context) -> Check:
    env = ctx.process_env()
    interfaces = ctx.probe.listdir(NET_CLASS)
    named = {k: env[k] for k in SOCKET_IFNAMES if env.get(k)}
    if not named:
        if ctx.multi_node:
            return Check(
                "env.socket_ifname",
                Status.WARN,
                "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME unset on a multi-node run: bootstrap may pick a "
                "docker or virtual bridge that other nodes cannot reach",
                "+comm.env.NCCL_SOCKET_IFNAME=<mgmt NIC> +comm.env.GLOO_SOCKET_IFNAME=<mgmt NIC>",
            )
        return Check("env.socket_ifname", Status.PASS, "unset (automatic interface choice)")
    if interfaces is None:
        return Check("env.socket_ifname", Status.SKIP, f"{NET_CLASS} is not readable; set: {named}")
    bad = []
    found = []
    for name, spec in named.items():
        ok, hits = _matches(spec, interfaces)
        (found if ok else bad).append(f"{name}={spec}" + (f" -> {hits}" if ok else ""))
    if bad:
        return Check(
            "env.socket_ifname",
            Status.FAIL,
            f"{'; '.join(bad)} matches no interface here (interfaces: {', '.join(interfaces)})",
            "name an existing interface (`ip -br link`), the management NIC every node has",
        )
    return Check("env.socket_ifname", Status.PASS, "; ".join(found))


def check_sglang_env(ctx: Context) -> Check:
    """SGLang's DeepSeek-V4 variables as the engines will see them, judged by `dsv4rl.quant.sglang_env`."""
    cfg = ctx.cfg
    shell_sglang = sorted(k for k in ctx.facts.env if k.startswith("SGLANG_"))
    if cfg is not None and cfg.parallel.rollout.engine != RolloutEngineKind.sglang:
        return Check("env.sglang", Status.SKIP, "the recipe uses the reference engine, not SGLang")
    if cfg is None:
        env = ctx.facts.env
        if not shell_sglang:
            return Check("env.sglang", Status.SKIP, f"no SGLANG_* variable set; {NO_RECIPE}")
        try:
            held = sglang_env.expert_format(env, RELEASED_CHECKPOINT_EXPERTS)
        except ValueError as error:
            return Check("env.sglang", Status.FAIL, str(error), "use 1/0 or true/false")
        detail = f"{_show(shell_sglang, env)}: SGLang would hold the released checkpoint's experts as {held}"
        if env.get(sglang_env.FP4_EXPERTS) is not None and held == sglang_env.FP8:
            return Check(
                "env.sglang",
                Status.WARN,
                f"{detail}, but {sglang_env.FP4_EXPERTS}=0 converts nothing: it declares an FP8-expert "
                "checkpoint, and the released MXFP4 one then fails to load",
                f"unset {sglang_env.FP4_EXPERTS} (FP8 experts from MXFP4 ones: {sglang_env.FP4_DEQUANT}=1)",
            )
        return Check("env.sglang", Status.PASS, detail)
    env = {**ctx.facts.env, **engine_env(cfg)}  # what the planner hands an SGLang engine
    problems = sglang_env.env_problems(cfg.quant.name, env)
    inherited = [k for k in shell_sglang if k not in engine_env(cfg)]
    if problems:
        source = f" (from this shell: {_show(inherited, env)})" if inherited else ""
        return Check(
            "env.sglang",
            Status.FAIL,
            "; ".join(problems) + source,
            f"unset the shell's {', '.join(inherited)} (engines inherit it)"
            if inherited
            else "fix quant.engine_env as the detail says",
        )
    held = sglang_env.expert_format(env, None)
    detail = f"quant={cfg.quant.name.value}: SGLang engines hold {held} experts"
    if inherited:
        detail += f"; inherited from this shell: {_show(inherited, env)}"
    return Check("env.sglang", Status.PASS, detail)


CHECKS = (
    check_comm_preset,
    check_stale_rccl,
    check_visible_devices,
    check_xnack,
    check_socket_ifname,
    check_sglang_env,
)
