"""Cross-field rules for a composed recipe, checked before any process starts.

The schema (`dsv4rl.config.schema`) already fixes key names and types; these rules catch settings that
are individually well-typed but impossible together (a parallel layout that does not divide the world,
a batch that does not split across data-parallel ranks, a backend without GPUs). Every problem is
reported at once, each naming the key, the value and the fix. The rules live by concern in
`parallel` (layouts, cluster, ports), `run` (algorithm, model, data, sync, engine) and
`quant` (quant modes against the engines and checkpoints), `sglang_families` (what SGLang runs on
the GPU family of `cluster.device`, one row per finding), `machine` (paths, addresses,
what is built) and `estimate` (the memory plan against the device); this module runs them and keeps
the public names.
"""

from __future__ import annotations

from collections.abc import Callable

from dsv4rl.checks import machine
from dsv4rl.checks.estimate import check_estimate, check_memory_budget
from dsv4rl.checks.numerics import check_numerics
from dsv4rl.checks.parallel import check_comm, check_nodes_and_rollout, check_ports, check_train_layout
from dsv4rl.checks.problems import Add
from dsv4rl.checks.quant import check_checkpoint_format, check_quant
from dsv4rl.checks.replay import check_replay
from dsv4rl.checks.reward import check_reward, check_reward_targets
from dsv4rl.checks.rollout import check_rollout, check_rollout_targets
from dsv4rl.checks.run import (
    GRADERS,
    LAYER_TYPES,
    MLP_TYPES,
    PAUSE_MODES,
    check_algo,
    check_data_reward_eval,
    check_model,
    check_optim,
    check_run,
)
from dsv4rl.checks.sglang_families import check_families
from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import Config

__all__ = [
    "ConfigError",
    "validate",
    "GRADERS",
    "PAUSE_MODES",
    "LAYER_TYPES",
    "MLP_TYPES",
]

# Rules that read only the recipe; the path checks below also read this machine.
_CHECKS: list[Callable[[Config, Add], None]] = [
    check_train_layout,
    check_nodes_and_rollout,
    machine.check_cluster_addresses,
    check_comm,
    check_algo,
    check_replay,
    check_optim,
    check_model,
    check_data_reward_eval,
    check_reward,
    check_rollout,
    check_run,
    check_quant,
    check_families,
    check_numerics,
    check_ports,
    check_estimate,
]


def validate(cfg: Config, check_paths: bool = True) -> None:
    """Raise ConfigError listing every impossible setting of `cfg`.

    `check_paths=False` skips the checks that read this machine or its environment (model, tokenizer
    and data paths; a real master address for multi-node runs) and whether the model is built to run (a
    planned-only architecture), so a cluster recipe can be composed, inspected and planned anywhere
    (`dsv4rl train --cfg`, `dsv4rl plan`).
    """
    problems: list[str] = []
    for check in _CHECKS:
        check(cfg, problems.append)
    if not problems:  # the memory plan needs a layout that divides
        check_memory_budget(cfg, problems.append)
    if check_paths:
        machine.check_buildable_model(cfg, problems.append)
        machine.check_paths(cfg, problems.append)
        check_checkpoint_format(cfg, problems.append)
        machine.check_model_layout(cfg, problems.append)
        machine.check_transformer_engine(cfg, problems.append)
        check_reward_targets(cfg, problems.append)  # imports the user's reward modules
        check_rollout_targets(cfg, problems.append)  # and their tools / environment
    if len(problems) == 1:
        raise ConfigError(f"recipe {cfg.recipe!r}: {problems[0]}", problems)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"recipe {cfg.recipe!r} has {len(problems)} problems:\n{listing}", problems)
