"""Every config group option and every enum value, composed into tiny_arith one at a time: validated, and
built when valid (the trainer backend, the grader, the prompt stream, the eval set, the weight-sync sources
and the node's processes; no step runs). Usage: every_value.py OUT.json [CASE ...]; one JSON line per case."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import tempfile
import traceback
import typing
from pathlib import Path

from dsv4rl.config import schema
from dsv4rl.config.choices import FreezeGroup, RewardOnError
from dsv4rl.config.compose import ConfigError, compose, list_groups

RECIPE = "tiny_arith"


def enum_fields(cls: type = schema.Config, prefix: str = "") -> list[tuple[str, type[enum.StrEnum]]]:
    """(dotted key, its StrEnum) of every enum-typed key of the schema."""
    hints = typing.get_type_hints(cls)  # the schema spans modules (config.model_schema, config.choices)
    out = []
    for name in (f.name for f in dataclasses.fields(cls)):
        kind = hints[name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            out += enum_fields(kind, f"{prefix}{name}.")
        elif isinstance(kind, type) and issubclass(kind, enum.StrEnum):
            out.append((prefix + name, kind))
    return out


def list_entry_cases() -> list[str]:
    """The enum keys of list entries (`reward.fns[].on_error`) and the enum values a list of strings takes
    (`train.freeze`'s groups): one entry of the list per value."""
    entry = "{{name: f, target: 'builtin:arith', on_error: {value}}}"
    cases = [f"reward.fns=[{entry.format(value=value.value)}]" for value in RewardOnError]
    return cases + [f"train.freeze=[{group.value}]" for group in FreezeGroup]


def all_cases() -> list[str]:
    """One override per case: `group=option`, or `key=value` for every value of every enum key."""
    cases = [f"{group}={option}" for group, options in sorted(list_groups().items()) for option in options]
    cases += [f"{key}={value.value}" for key, kind in enum_fields() for value in kind]
    return cases + list_entry_cases()


def build(cfg: schema.Config, root: Path, models: dict) -> None:
    """What a run builds from the recipe before its first step, in this process (a world of 1)."""
    import torch

    from dsv4rl.config.compose import reward_base_dirs
    from dsv4rl.data.chat_format import data_chat_settings
    from dsv4rl.data.stream import build_prompt_stream
    from dsv4rl.eval.data import eval_problems
    from dsv4rl.launcher.plan import build_local_plan
    from dsv4rl.model.model_dir import materialize_model
    from dsv4rl.model.tiny import checkpoint_wire_format
    from dsv4rl.model.tokenizer import run_tokenizer
    from dsv4rl.reward.graders import get_grader
    from dsv4rl.reward.rewarder import RewardSet
    from dsv4rl.rollout.multi_turn import build_multi_turn
    from dsv4rl.topology import weight_sync_sources
    from dsv4rl.train.backend import build_backend

    key = (json.dumps(dataclasses.asdict(cfg.model), sort_keys=True, default=str), cfg.quant.name.value)
    if key not in models:
        models[key] = materialize_model(cfg.model, str(root / f"model-{len(models)}"), cfg.quant)
    checkpoint_wire_format(cfg.quant)
    get_grader(cfg.reward.grader, reward=cfg.reward)
    RewardSet.from_config(cfg.reward, reward_base_dirs(cfg)).close()  # reward.fns, remote, judge
    build_prompt_stream(cfg).next_batch()
    build_multi_turn(cfg, run_tokenizer(cfg.model), data_chat_settings(cfg.data), reward_base_dirs(cfg))
    if cfg.eval is not None:
        eval_problems(cfg)
    weight_sync_sources(cfg)
    build_local_plan(cfg, root / "run")
    backend = build_backend(cfg, models[key], torch.device("cpu"))
    assert list(backend.weight_source_ranks) == [0]
    del backend


def main() -> None:
    import torch.distributed as dist

    out = Path(sys.argv[1])
    cases = sys.argv[2:] or all_cases()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    models: dict = {}
    with tempfile.TemporaryDirectory() as tmp, out.open("w") as results:
        for case in cases:
            row = {"case": case, "valid": False, "errors": [], "built": False, "build_error": None}
            try:
                cfg = compose(RECIPE, [case])
                from dsv4rl.checks.validate import validate

                validate(cfg)
                row["valid"] = True
                build(cfg, Path(tmp), models)
                row["built"] = True
            except ConfigError as exc:
                row["errors"] = list(getattr(exc, "problems", None) or [str(exc)])
            except Exception as exc:  # a valid recipe that does not build: the defect the test is after
                row["build_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
            results.write(json.dumps(row) + "\n")
            results.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
