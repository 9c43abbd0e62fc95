"""The interpreter SGLang engines run in, and the check that it can serve this run.

SGLang 0.5.23 pins its own torch (2.14.1) and transformers (5.19.0); dsv4rl's trainer needs transformers
5.23 for `DeepseekV4ForCausalLM`. The two cannot share one environment, so engines run with
`engine.python` (an environment of their own). The weight-update process group still joins both sides,
and torch.distributed only interoperates within one torch release (and one of NCCL or RCCL), so the
check compares the engine environment's torch with the trainer's before anything starts.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dsv4rl.config.choices import RolloutEngineKind
from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import Config

SGLANG_VERSION = "0.5.23"  # the release dsv4rl's contract is pinned to (dsv4rl/engine/sglang_contract.json)
_PROBE_MARK = "DSV4RL_PROBE "
_PROBE = f"""
import importlib.metadata as metadata, json, sys
out = {{"executable": sys.executable, "python": sys.version.split()[0]}}
for dist in ("torch", "sglang"):
    try:
        out[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        out[dist] = None
try:
    import sglang  # noqa: F401
except BaseException as error:
    out["import_error"] = f"{{type(error).__name__}}: {{error}}"
print({_PROBE_MARK!r} + json.dumps(out), flush=True)
"""
INSTALL_FIX = (
    "run `make install-sglang` (creates .venv-sglang) or point engine.python at SGLang's interpreter"
)
SKIP_HINT = "(`dsv4rl plan --skip-engine-check` shows the plan on a machine that is not a cluster node)"


@dataclass(frozen=True)
class InterpreterInfo:
    """What one Python interpreter has installed (versions from package metadata)."""

    executable: str
    python: str | None = None
    torch: str | None = None
    sglang: str | None = None
    import_error: str | None = None  # `import sglang` failed: the exception
    failure: str | None = None  # the interpreter did not run at all


def engine_python(cfg: Config) -> str:
    """The interpreter the planner starts SGLang engines with (absolute; relative paths from the cwd)."""
    if cfg.engine.python is None:
        return sys.executable
    path = Path(cfg.engine.python).expanduser()
    return str(path if path.is_absolute() else Path.cwd() / path)


def torch_release(version: str | None) -> str | None:
    """'2.14.1+rocm6.4' -> '2.14.1': the part both ends of a process group must share."""
    return None if version is None else version.split("+", 1)[0]


def torch_is_rocm(version: str | None) -> bool:
    return version is not None and "+rocm" in version


def trainer_torch() -> str:
    return importlib.metadata.version("torch")


@functools.lru_cache(maxsize=8)
def probe_interpreter(python: str, timeout_s: float = 300.0) -> InterpreterInfo:
    """Run `python` once: its torch and sglang versions, and whether `import sglang` works."""
    if not Path(python).exists():
        return InterpreterInfo(python, failure="no such file")
    if not os.access(python, os.X_OK):
        return InterpreterInfo(python, failure="not executable")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        result = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return InterpreterInfo(python, failure=f"{type(error).__name__}: {error}")
    lines = [line for line in result.stdout.splitlines() if line.startswith(_PROBE_MARK)]
    if not lines:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        return InterpreterInfo(python, failure=f"exited {result.returncode}: {tail}")
    data = json.loads(lines[-1][len(_PROBE_MARK) :])
    return InterpreterInfo(
        python,
        python=data.get("python"),
        torch=data.get("torch"),
        sglang=data.get("sglang"),
        import_error=data.get("import_error"),
    )


def interpreter_problems(info: InterpreterInfo, trainer_torch_version: str) -> list[str]:
    """Why `info` cannot run this run's SGLang engines (empty: it can), each with the fix."""
    where = f"engine.python={info.executable}"
    if info.failure is not None:
        return [f"{where} cannot run ({info.failure}): {INSTALL_FIX}"]
    problems = []
    if info.sglang is None or info.import_error is not None:
        why = (
            "sglang is not installed"
            if info.sglang is None
            else f"`import sglang` fails: {info.import_error}"
        )
        problems.append(f"{where}: {why}; {INSTALL_FIX}")
    elif info.sglang != SGLANG_VERSION:
        problems.append(
            f"{where} has sglang {info.sglang}, but dsv4rl's engine contract is pinned to {SGLANG_VERSION}: "
            f"install sglang=={SGLANG_VERSION} there (`make install-sglang`)"
        )
    if info.torch is None:
        problems.append(f"{where} has no torch; {INSTALL_FIX}")
    elif torch_release(info.torch) != torch_release(trainer_torch_version) or torch_is_rocm(
        info.torch
    ) != torch_is_rocm(trainer_torch_version):
        problems.append(
            f"{where} runs torch {info.torch} but the trainer runs torch {trainer_torch_version}: both ends "
            "of the weight-update process group must run one torch release (and one of NCCL or RCCL); "
            f"install the trainer with SGLang's torch (`make install GPU=1` takes torch==2.14.1) or an "
            "engine environment with the trainer's"
        )
    return problems


def node_runs_sglang(cfg: Config, nodes: list[int] | None = None) -> bool:
    from dsv4rl.topology import engines_on_node

    if cfg.parallel.rollout.engine != RolloutEngineKind.sglang:
        return False
    nodes = [cfg.cluster.node_rank] if nodes is None else nodes
    return any(engines_on_node(cfg, node) for node in nodes)


def check_engine_python(cfg: Config, nodes: list[int] | None = None) -> list[str]:
    """Problems with the SGLang interpreter of `nodes` (default: this node); [] when no SGLang runs there."""
    if not node_runs_sglang(cfg, nodes):
        return []
    return interpreter_problems(probe_interpreter(engine_python(cfg)), trainer_torch())


def require_engine_python(cfg: Config, nodes: list[int] | None = None, hint: str = "") -> None:
    """Refuse a recipe whose SGLang interpreter cannot serve this run (missing, no sglang, another torch)."""
    problems = check_engine_python(cfg, nodes)
    if problems:
        text = problems[0]
        if len(problems) > 1:
            text = "the SGLang interpreter cannot serve this run:\n" + "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"recipe {cfg.recipe!r}: {text}{hint}", problems)
