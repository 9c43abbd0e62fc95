"""The algorithm's part of the schema (`algo.*`): the loss, its corrections, the sampling and the
staleness bound. `dsv4rl.config.schema` re-exports every class, so recipes and code import them from
there as before."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4rl.config.choices import AlgorithmName, KLEstimator, LossAggregation


@dataclass
class TISConfig:
    # None: on where the run trains off-policy (a staleness bound >= 1) and MIS is off; else off
    enabled: bool | None = None
    clip: float = 2.0


@dataclass
class MISConfig:
    """Masked importance sampling: tokens whose train/rollout ratio lies outside [low, high] get no loss."""

    enabled: bool = False
    low: float = 0.5
    high: float = 2.0


@dataclass
class OversampleConfig:
    """The fully asynchronous stream's over-sampling (algo.max_staleness >= 2): `factor` times the groups
    the staleness bound admits are started, and finished groups pass `filter` (builtin:nonzero_std, or a
    user's `pkg.module:fn` / `file.py:fn`, dsv4rl.reward.group_filter) before a batch takes them; those
    left over wait for the next batch, within the bound."""

    factor: float = 1.0
    filter: str = ""
    timeout_s: float = 30.0  # a user's filter, per group


@dataclass
class DynamicSamplingConfig:
    """DAPO: drop groups whose rewards are all equal, over-sample to refill the batch."""

    enabled: bool = False
    max_oversample_factor: float = 3.0


@dataclass
class OverlongConfig:
    """DAPO soft overlong punishment: penalty grows linearly to `penalty` over the buffer."""

    enabled: bool = False
    expected_len: int = 16384
    buffer_len: int = 4096
    penalty: float = 1.0


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128


@dataclass
class AlgoConfig:
    name: AlgorithmName = AlgorithmName.grpo
    prompts_per_step: int = 16
    group_size: int = 8  # responses per prompt
    normalize_std: bool = True  # false: Dr.GRPO (no division by the group std)
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    loss_aggregation: LossAggregation = LossAggregation.token_mean
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    entropy_coef: float = 0.0
    updates_per_step: int = 1  # optimizer steps (mini-batches) per rollout batch
    # One step off-policy: step k+1's rollout runs on the engines while the trainer trains on step k's batch.
    async_rollout: bool = False
    # How many weight versions behind the trained policy a sample may be (counted from its first token):
    # 0 synchronous, 1 one step off-policy (what async_rollout=true means); unset, async_rollout decides.
    max_staleness: int | None = None
    # Replay the engine's discrete choices in training (docs/sglang.md, "Routing and indexer replay"): the
    # rollout's experts in score-routed MoE layers (weights still the trainer's scores at those experts),
    # and the rollout's CSA indexer top-k. The engines return them (--enable-return-routed-experts /
    # --enable-return-indexer-topk); metrics.jsonl reports the share of decisions that differed.
    routing_replay: bool = False
    indexer_replay: bool = False
    tis: TISConfig = field(default_factory=TISConfig)
    mis: MISConfig = field(default_factory=MISConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    oversample: OversampleConfig = field(default_factory=OversampleConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
