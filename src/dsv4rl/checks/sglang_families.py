"""What SGLang 0.5.23 supports on each GPU family, as validation reads it: one row per finding.

A row names a feature a recipe can ask SGLang engines for, the setting that asks for it, the families
(`cluster.device` -> `DeviceFamily`, `dsv4rl.quant.sglang_moe.DEVICE_FAMILY`) where the released code
runs it, what happens elsewhere with the code that says so, and what works instead. `check_families`
refuses a recipe whose engines would meet one of them, before any process starts: on a family outside
the row's, and on `cluster.device=cpu` with SGLang engines (the family is unknown), where the message
names the override, `cluster.device`. The MoE runner's update path depends on the expert format and
aiter as well as the family: its row defers to the table of its own (`sglang_moe.MOE_PATHS`).

The next finding is one more row of `FINDINGS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import RolloutEngineKind
from dsv4rl.config.schema import Config
from dsv4rl.config.sglang_choices import DeviceFamily
from dsv4rl.quant import sglang_env, sglang_moe

__all__ = ["FINDINGS", "FamilyFinding", "MoeUpdateFinding", "check_families", "kinds_of"]

HOPPER = frozenset({DeviceFamily.hopper})
DISABLE_CUSTOM_ALL_REDUCE = "--disable-custom-all-reduce"


def kinds_of(families: frozenset[DeviceFamily]) -> list[str]:
    """The `cluster.device` values of `families`, for a message."""
    return [kind.value for kind, family in sglang_moe.DEVICE_FAMILY.items() if family in families]


def _sglang(cfg: Config) -> bool:
    return cfg.parallel.rollout.engine == RolloutEngineKind.sglang


@dataclass(frozen=True)
class FamilyFinding:
    """A feature SGLang runs on some families only."""

    feature: str  # what the recipe asks the engines for, in words
    key: str  # the setting that asks for it, as a recipe spells it
    asks: Callable[[Config], bool]  # this recipe's SGLang engines would use the feature
    runs_on: frozenset[DeviceFamily]  # where SGLang 0.5.23 runs it
    elsewhere: str  # what happens on the other families, in a sentence
    source: str  # where the released code says so (sglang/srt/...:line)
    fix: str  # what works instead

    def problem(self, cfg: Config) -> str | None:
        if not (_sglang(cfg) and self.asks(cfg)):
            return None
        family = sglang_moe.device_family(cfg.cluster.device)
        if family in self.runs_on:
            return None
        where = ", ".join(kinds_of(self.runs_on))
        if family == DeviceFamily.unknown:
            return (
                f"{self.key} asks SGLang for {self.feature}, which SGLang 0.5.23 runs on {where} only, but "
                f"cluster.device={cfg.cluster.device.value} does not name the GPU: set cluster.device to the "
                f"nodes' GPU (cluster.device={kinds_of(self.runs_on)[0]} runs it), or {self.fix}"
            )
        return (
            f"{self.key} asks SGLang for {self.feature}, which SGLang 0.5.23 runs on {where} only: on "
            f"{cfg.cluster.device.value} ({family.value}) {self.elsewhere} ({self.source}); {self.fix}"
        )


@dataclass(frozen=True)
class MoeUpdateFinding:
    """Weight updates of the MoE layers: whether a complete push works depends on the expert format and
    aiter as well as the family, so this row reads `sglang_moe.MOE_PATHS` (`moe_refusal`)."""

    feature: str = "weight updates of its MoE layers"
    key: str = "quant"

    def problem(self, cfg: Config) -> str | None:
        if not _sglang(cfg) or sglang_env.env_problems(cfg.quant.name, sglang_env.engine_env(cfg)):
            return None  # an environment that does not parse is reported by check_quant
        return sglang_moe.moe_refusal(cfg)


def _indexer_replay(cfg: Config) -> bool:
    return cfg.algo.indexer_replay


def _deterministic_without_custom_all_reduce(cfg: Config) -> bool:
    flags = {str(arg).split("=", 1)[0] for arg in cfg.engine.extra_args}
    tp = cfg.parallel.rollout.tensor_parallel
    return cfg.engine.reproducible_sampling and tp > 2 and DISABLE_CUSTOM_ALL_REDUCE in flags


FINDINGS: list[FamilyFinding | MoeUpdateFinding] = [
    FamilyFinding(
        feature="the CSA indexer's top-k of every token (--enable-return-indexer-topk)",
        key="algo.indexer_replay=true",
        asks=_indexer_replay,
        runs_on=HOPPER,
        elsewhere="SGLang wires the capture for CUDA and NPU only (its own note: other backends create a "
        "capturer but never feed it), so the trainer cannot count on the engines' indexer rows",
        source="sglang/srt/state_capturer/indexer_topk.py:99-107",
        fix="set algo.indexer_replay=false (routing replay, algo.routing_replay, runs on every family)",
    ),
    FamilyFinding(
        feature=f"deterministic inference (engine.reproducible_sampling) with {DISABLE_CUSTOM_ALL_REDUCE}",
        key="engine.reproducible_sampling=true",
        asks=_deterministic_without_custom_all_reduce,
        runs_on=HOPPER,
        elsewhere="SGLang refuses to start above two TP ranks: RCCL's all-reduce is not batch-invariant, "
        "deterministic TP on ROCm needs its one-stage custom all-reduce",
        source="sglang/srt/arg_groups/overrides.py:1074-1088",
        fix=f"remove {DISABLE_CUSTOM_ALL_REDUCE} from engine.extra_args, or set "
        "engine.reproducible_sampling=false",
    ),
    MoeUpdateFinding(),
]


def check_families(cfg: Config, add: Add) -> None:
    """Every finding this recipe's SGLang engines would meet on `cluster.device`."""
    for finding in FINDINGS:
        problem = finding.problem(cfg)
        if problem:
            add(problem)
