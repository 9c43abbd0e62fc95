"""Run-setting rules: algorithm, sampling, optimizer, model (tiny), data / reward / eval, sync and engine.

These read only the recipe, so `dsv4rl train --cfg` checks them on any machine.
"""

from __future__ import annotations

import math

from dsv4rl.algo.staleness import staleness_bound, tis_on
from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import (
    EvalScoredBy,
    EvalSet,
    GraderName,
    LoggerKind,
    LRSchedule,
    ModelArchitecture,
    OptimizerName,
    RolloutEngineKind,
)
from dsv4rl.config.model_schema import LAYER_TYPES, MLP_TYPES
from dsv4rl.config.schema import Config, SamplingConfig, WandbConfig
from dsv4rl.config.sglang_choices import PauseMode
from dsv4rl.data.chat_format import data_chat_settings, eval_chat_settings, settings_problems
from dsv4rl.model.freeze import entry_problems as freeze_entry_problems
from dsv4rl.model.release_config import (
    ReleaseConfigError,
    release_keys,
    sglang_problems,
    tiny_transformers_keys,
)
from dsv4rl.quant.sglang_moe import EMULATE_FLAG
from dsv4rl.topology import data_parallel_size, topology

GRADERS = tuple(GraderName)
PAUSE_MODES = tuple(PauseMode)
OPTIMIZERS = tuple(OptimizerName)
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
PROCEDURAL_DATA = ("tiny_arith", "tiny_tool")  # data.name values that read no file


def _check_sampling(prefix: str, s: SamplingConfig, add: Add) -> None:
    if s.temperature < 0:
        add(f"{prefix}.temperature must be >= 0 (got {s.temperature}; 0 means greedy)")
    if not 0.0 < s.top_p <= 1.0:
        add(f"{prefix}.top_p must be in (0, 1] (got {s.top_p})")
    if s.top_k != -1 and s.top_k < 1:
        add(f"{prefix}.top_k must be -1 (off) or >= 1 (got {s.top_k})")
    if s.max_new_tokens < 1:
        add(f"{prefix}.max_new_tokens must be >= 1 (got {s.max_new_tokens})")


def check_algo(cfg: Config, add: Add) -> None:
    a = cfg.algo
    if a.group_size < 2:
        add(
            f"algo.group_size={a.group_size}: GRPO compares responses to the same prompt, so a group "
            "needs >= 2 responses"
        )
    if a.prompts_per_step < 1:
        add(f"algo.prompts_per_step must be >= 1 (got {a.prompts_per_step})")
    if a.updates_per_step < 1:
        add(f"algo.updates_per_step must be >= 1 (got {a.updates_per_step})")
    bound = staleness_bound(a)
    off_policy = "algo.async_rollout=true" if a.max_staleness is None else f"algo.max_staleness={bound}"
    if a.max_staleness is not None and a.max_staleness < 0:
        add(f"algo.max_staleness must be >= 0 (got {a.max_staleness}): 0 trains on-policy")
    if a.async_rollout and a.max_staleness == 0:
        add(
            "algo.async_rollout=true generates each batch one weight version behind, but "
            "algo.max_staleness=0 allows none: drop one of them (algo.max_staleness=1 is the same as "
            "algo.async_rollout=true)"
        )
    o = a.oversample
    if o.factor < 1:
        add(f"algo.oversample.factor must be >= 1 (got {o.factor:g}): groups started per group a batch takes")
    elif (o.factor > 1 or o.filter) and bound < 2:
        add(
            f"algo.oversample (factor {o.factor:g}, filter {o.filter or 'none'}) over-samples the fully "
            f"asynchronous stream, but the staleness bound is {bound}: set algo.max_staleness=2 or more, or "
            "over-sample synchronous steps with algo.dynamic_sampling.enabled=true"
        )
    if o.timeout_s <= 0:
        add(f"algo.oversample.timeout_s must be > 0 (got {o.timeout_s:g})")
    if bound >= 1 and not (tis_on(a) or a.mis.enabled):
        add(
            f"{off_policy} trains on samples up to {bound} weight version(s) old, but algo.tis.enabled=false "
            "and MIS is off: turn on the correction for it, algo.tis.enabled=true (or unset, or "
            "algo.mis.enabled=true)"
        )
    if bound >= 1 and cfg.parallel.colocate:
        add(
            f"{off_policy} needs the engines generating while the trainer trains, but "
            "parallel.colocate=true gives the devices to one at a time: turn one of them off"
        )
    if not 0.0 < a.eps_clip_low < 1.0:
        add(f"algo.eps_clip_low must be in (0, 1) (got {a.eps_clip_low}); the ratio is clipped at 1 - eps")
    if a.eps_clip_high <= 0.0:
        add(f"algo.eps_clip_high must be > 0 (got {a.eps_clip_high})")
    if a.kl_coef < 0:
        add(f"algo.kl_coef must be >= 0 (got {a.kl_coef})")
    if a.tis.clip <= 0:
        add(f"algo.tis.clip must be > 0 (got {a.tis.clip})")
    if not 0.0 < a.mis.low <= 1.0 <= a.mis.high:
        add(
            f"algo.mis.low and high must satisfy 0 < low <= 1 <= high (got {a.mis.low}, {a.mis.high}): MIS "
            "keeps tokens whose train/rollout ratio lies in [low, high]"
        )
    if a.dynamic_sampling.max_oversample_factor < 1:
        add(
            "algo.dynamic_sampling.max_oversample_factor must be >= 1 "
            f"(got {a.dynamic_sampling.max_oversample_factor})"
        )
    _check_sampling("algo.sampling", a.sampling, add)
    o = a.overlong
    if o.enabled:
        if o.expected_len < 1 or o.buffer_len < 1:
            add(
                "algo.overlong.expected_len and buffer_len must be >= 1 "
                f"(got {o.expected_len}, {o.buffer_len})"
            )
        elif o.expected_len >= a.sampling.max_new_tokens:
            add(
                f"algo.overlong.expected_len={o.expected_len} is not below algo.sampling.max_new_tokens="
                f"{a.sampling.max_new_tokens}, so the overlong penalty can never apply: lower expected_len "
                "or disable algo.overlong"
            )
        if o.penalty < 0:
            add(f"algo.overlong.penalty must be >= 0 (got {o.penalty}; it is subtracted)")
    if a.group_size >= 1 and a.prompts_per_step >= 1 and a.updates_per_step >= 1:
        samples = a.prompts_per_step * a.group_size
        dp = data_parallel_size(cfg)
        if dp >= 1 and samples % (dp * a.updates_per_step):
            add(
                f"algo.prompts_per_step x group_size = {samples} responses must split evenly into "
                f"algo.updates_per_step={a.updates_per_step} mini-batches over {dp} data-parallel ranks "
                f"(a multiple of {dp * a.updates_per_step})"
            )


LR_SCHEDULES = tuple(LRSchedule)


def check_optim(cfg: Config, add: Add) -> None:
    o = cfg.optim
    if o.name not in OPTIMIZERS:
        add(f"optim.name={o.name!r} is not supported; choose one of {', '.join(OPTIMIZERS)}")
    if o.lr <= 0:
        add(f"optim.lr must be > 0 (got {o.lr})")
    if o.weight_decay < 0:
        add(f"optim.weight_decay must be >= 0 (got {o.weight_decay})")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        add(f"optim.betas must be two values in [0, 1) (got {list(o.betas)})")
    if o.eps <= 0:
        add(f"optim.eps must be > 0 (got {o.eps})")
    if o.grad_clip < 0:
        add(f"optim.grad_clip must be >= 0 (got {o.grad_clip}; 0 disables clipping)")
    if o.warmup_steps < 0:
        add(f"optim.warmup_steps must be >= 0 (got {o.warmup_steps})")
    if o.lr_schedule not in LR_SCHEDULES:
        add(f"optim.lr_schedule={o.lr_schedule!r} is not known; choose one of {', '.join(LR_SCHEDULES)}")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        add(f"optim.min_lr_ratio must be in [0, 1] (got {o.min_lr_ratio})")


def _longest_sequence(cfg: Config) -> tuple[int, str]:
    """The longest sequence the model sees, and the key of its response cap (training's or the eval's)."""
    new_tokens, key = cfg.algo.sampling.max_new_tokens, "algo.sampling.max_new_tokens"
    if cfg.eval is not None and cfg.eval.sampling.max_new_tokens > new_tokens:
        new_tokens = cfg.eval.sampling.max_new_tokens
        key = f"eval.sampling.max_new_tokens (eval={cfg.eval.name})"
    return cfg.data.max_prompt_len + new_tokens, key


# An indexer that selects fewer entries than are visible needs this many heads to avoid exact ties
MIN_SELECTING_INDEX_HEADS = 8


def check_model(cfg: Config, add: Add) -> None:
    m, tiny = cfg.model, cfg.model.tiny
    if m.path is None:
        n = tiny.num_hidden_layers
        if n < 1:
            add(f"model.tiny.num_hidden_layers must be >= 1 (got {n})")
        for key, values, allowed in (
            ("layer_types", tiny.layer_types, LAYER_TYPES),
            ("mlp_layer_types", tiny.mlp_layer_types, MLP_TYPES),
        ):
            if len(values) != n:
                add(
                    f"model.tiny.{key} lists {len(values)} entries but num_hidden_layers={n}: "
                    "give one per layer"
                )
            unknown = sorted(set(values) - set(allowed))
            if unknown:
                add(f"model.tiny.{key} has unknown values {unknown}; choose from {', '.join(allowed)}")
        _check_tiny_release_keys(cfg, add)
        if not 1 <= tiny.num_experts_per_tok <= tiny.n_routed_experts:
            add(
                f"model.tiny.num_experts_per_tok={tiny.num_experts_per_tok} must be in 1..n_routed_experts="
                f"{tiny.n_routed_experts}"
            )
        longest, cap = _longest_sequence(cfg)
        if tiny.max_position_embeddings < longest:
            add(
                f"model.tiny.max_position_embeddings={tiny.max_position_embeddings} is below the longest "
                f"sequence ({longest} = data.max_prompt_len {cfg.data.max_prompt_len} (data={cfg.data.name}) "
                f"+ {cap} {longest - cfg.data.max_prompt_len}): shorten them or raise max_position_embeddings"
            )
        uses_csa = "compressed_sparse_attention" in tiny.layer_types
        if (
            uses_csa
            and cfg.parallel.rollout.engine == RolloutEngineKind.reference
            and tiny.csa_compress_rate >= 1
        ):
            needed = math.ceil(longest / tiny.csa_compress_rate)
            # With few indexer heads, entries often score exactly 0 (every head's ReLU is 0), and
            # torch.topk breaks such ties differently for different numbers of entries.
            if tiny.index_topk < needed and tiny.index_n_heads < MIN_SELECTING_INDEX_HEADS:
                add(
                    f"model.tiny.index_topk={tiny.index_topk} is below "
                    f"ceil(({cfg.data.max_prompt_len} prompt + "
                    f"{longest - cfg.data.max_prompt_len} new tokens) / csa_compress_rate "
                    f"{tiny.csa_compress_rate}) = {needed} with {tiny.index_n_heads} indexer heads: "
                    "zero-score ties would make the reference engine's cached decoding differ from a full "
                    "forward; set "
                    f"model.tiny.index_topk={needed}, or model.tiny.index_n_heads>="
                    f"{MIN_SELECTING_INDEX_HEADS} (as model=tiny_dsv4_align), or shorten "
                    "data.max_prompt_len / max_new_tokens"
                )
    else:
        if m.num_hidden_layers is not None and m.num_hidden_layers < 1:
            add(f"model.num_hidden_layers must be >= 1 (got {m.num_hidden_layers})")
        if m.n_routed_experts is not None and m.n_routed_experts < 1:
            add(f"model.n_routed_experts must be >= 1 (got {m.n_routed_experts})")
    _check_architecture_facts(cfg, add)


# The compress ratios each family's layers take (DeepSeek-V4: sliding, CSA, HCA; V4.1: sliding, 1, 2)
ARCHITECTURE_RATIOS = {ModelArchitecture.deepseek_v4: (0, 4, 128), ModelArchitecture.deepseek_v41: (0, 1, 2)}


def _check_architecture_facts(cfg: Config, add: Add) -> None:
    """The planning facts agree with `model.architecture` (a V4 recipe with V4.1's ratios or Engram would
    plan a model that does not exist)."""
    m = cfg.model
    allowed = ARCHITECTURE_RATIOS[m.architecture]
    if m.compress_ratios is not None:
        wrong = sorted(set(m.compress_ratios) - set(allowed))
        if wrong:
            add(
                f"model.compress_ratios has {wrong}, which model.architecture={m.architecture} layers do not "
                f"take (they take {list(allowed)}): fix the ratios or the architecture"
            )
        if m.num_hidden_layers is not None and len(m.compress_ratios) != m.num_hidden_layers:
            add(
                f"model.compress_ratios lists {len(m.compress_ratios)} layers but model.num_hidden_layers="
                f"{m.num_hidden_layers}: give one ratio per backbone layer (not the MTP layers)"
            )
    if m.architecture == ModelArchitecture.deepseek_v41 and cfg.algo.indexer_replay:
        add(
            "algo.indexer_replay=true with model.architecture=deepseek_v41: SGLang 0.5.23 captures indexer "
            "top-k only in V4's ratio-4 indexer, and sizes its capturer by the ratio-4 layers, of which V4.1 "
            "has none (srt/configs/model_config.py:548-563, srt/layers/attention/dsv4/indexer.py:928-1151), "
            "so there is nothing to replay: set algo.indexer_replay=false (routing replay, "
            "algo.routing_replay, is unaffected)"
        )
    if m.engram_params_b is not None and m.architecture != ModelArchitecture.deepseek_v41:
        add(
            f"model.engram_params_b is DeepSeek-V4.1's (its Engram tables); model.architecture="
            f"{m.architecture} has none: remove it or set model.architecture=deepseek_v41"
        )


def _check_tiny_release_keys(cfg: Config, add: Add) -> None:
    """The tiny model's config.json carries the release's keys beside transformers'
    (`dsv4rl.model.release_config`): they must be able to state its layers, and SGLang engines, which read
    only them, must build the layers transformers builds."""
    tiny = cfg.model.tiny
    n = tiny.num_hidden_layers
    if len(tiny.layer_types) != n or len(tiny.mlp_layer_types) != n:
        return  # reported above
    if not set(tiny.layer_types) <= set(LAYER_TYPES) or not set(tiny.mlp_layer_types) <= set(MLP_TYPES):
        return
    keys = tiny_transformers_keys(tiny)
    try:
        config = {**keys, **release_keys(keys)}
    except ReleaseConfigError as error:
        add(f"model.tiny: {error}")
        return
    if cfg.parallel.rollout.engine == RolloutEngineKind.sglang:
        for problem in sglang_problems(config):
            add(
                f"model.tiny with parallel.rollout.engine=sglang: {problem}; set "
                "model.tiny.csa_compress_rate=4, model.tiny.hca_compress_rate=128 and "
                "model.tiny.sliding_window=128, or use parallel.rollout.engine=reference"
            )


def check_data_reward_eval(cfg: Config, add: Add) -> None:
    d, r = cfg.data, cfg.reward
    if d.name not in PROCEDURAL_DATA and d.path is None:
        add(f"data.name={d.name!r} reads a file: set data.path=<jsonl or parquet file>")
    if d.path is not None and not d.path.endswith(DATA_SUFFIXES):
        add(f"data.path={d.path!r} must be a {' / '.join(DATA_SUFFIXES)} file")
    if d.max_prompt_len < 1:
        add(f"data.max_prompt_len must be >= 1 (got {d.max_prompt_len})")
    for problem in settings_problems(data_chat_settings(d), "data"):
        add(problem)
    if cfg.eval is not None and eval_chat_settings(cfg) != data_chat_settings(d):  # its own settings
        for problem in settings_problems(eval_chat_settings(cfg), "eval"):
            add(problem)
    if d.name == "tiny_arith":
        if d.arith.max_operand < 0 or d.arith.max_answer < 0:
            add("data.arith.max_operand and max_answer must be >= 0")
        if not d.arith.ops:
            add("data.arith.ops must list at least one operator")
    if r.grader not in GRADERS:
        add(f"reward.grader={r.grader!r} is unknown; choose one of {', '.join(GRADERS)}")
    if r.timeout_s <= 0:
        add(f"reward.timeout_s must be > 0 (got {r.timeout_s})")
    if r.num_workers < 1:
        add(f"reward.num_workers must be >= 1 (got {r.num_workers}): grader worker processes")
    if not 0.0 <= r.max_error_fraction <= 1.0:
        add(
            f"reward.max_error_fraction must be in [0, 1] (got {r.max_error_fraction}): the fraction of a "
            "batch's grader calls that may raise before the run stops"
        )
    if not 0.0 <= r.max_timeout_fraction <= 1.0:
        add(
            f"reward.max_timeout_fraction must be in [0, 1] (got {r.max_timeout_fraction}): the fraction "
            "of a step's calls of one reward function that may time out before the run stops (0: none may)"
        )
    if not (math.isfinite(r.step_timeout_s) and r.step_timeout_s >= 0):
        add(
            f"reward.step_timeout_s must be a number >= 0 (got {r.step_timeout_s}): the seconds a step's "
            "scoring may go on after its last sample is back (0: no limit)"
        )
    if d.holdout < 0:
        add(f"data.holdout must be >= 0 (got {d.holdout})")
    if cfg.eval is not None:
        check_eval(cfg, add)


def check_eval(cfg: Config, add: Add) -> None:
    """The eval set of a recipe that has one (`eval` not null)."""
    from dsv4rl.eval.data import TEMPLATES

    d, e = cfg.data, cfg.eval
    if e.grader not in GRADERS:
        add(f"eval.grader={e.grader!r} is unknown; choose one of {', '.join(GRADERS)}")
    if e.every_steps < 0:
        add(f"eval.every_steps must be >= 0 (got {e.every_steps}; 0: no periodic evaluation)")
    if e.pass_reward is not None and e.scored_by != EvalScoredBy.recipe:
        add(
            f"eval.pass_reward={e.pass_reward} sets when the recipe's reward counts a response as correct, "
            f"but the eval set's grader scores this eval: drop it, or set eval.scored_by=recipe (`dsv4rl "
            "eval` without an eval set does)"
        )
    if e.holdout < 0:
        add(f"eval.holdout must be >= 0 (got {e.holdout})")
    if e.name not in list(EvalSet):
        add(
            f"eval.name={e.name!r} is not an eval set; choose one of "
            f"{', '.join(EvalSet)}, or eval=none for no evaluation"
        )
    elif e.dataset is None and e.name != EvalSet.tiny_arith:
        add(f"eval.name={e.name!r} needs its data: data.path=<file> (dsv4rl eval), eval.dataset=<file>, "
            "or DSV4RL_DATA_DIR")  # fmt: skip
    if e.holdout and e.dataset == d.path and d.holdout < e.holdout:
        add(
            f"eval.holdout={e.holdout} scores the last {e.holdout} rows of {d.path}, but training reads "
            f"all but the last data.holdout={d.holdout}: set data.holdout={e.holdout} so it never trains "
            "on them"
        )
    if e.max_problems is not None and e.max_problems < 1:
        add(f"eval.max_problems must be >= 1 or null (got {e.max_problems})")
    template = e.prompt_template
    if template is not None and template not in TEMPLATES and "{problem}" not in template:
        add(
            f"eval.prompt_template={template!r} is neither a named template ({', '.join(TEMPLATES)}) "
            "nor a text with a {problem} placeholder"
        )
    if e.samples_per_problem < 1:
        add(f"eval.samples_per_problem must be >= 1 (got {e.samples_per_problem})")
    bad_k = [k for k in e.k if not 1 <= k <= e.samples_per_problem]
    if bad_k or not e.k:
        add(f"eval.k values must be in 1..samples_per_problem={e.samples_per_problem} (got {list(e.k)})")
    _check_sampling("eval.sampling", e.sampling, add)


def check_loggers(cfg: Config, add: Add) -> None:
    """`logger`: metrics.jsonl is always written (jsonl listed), each tracker once; `tracker.wandb.*` only
    matters with wandb listed, and its project then must not be empty."""
    kinds = list(cfg.logger)
    if LoggerKind.jsonl not in kinds:
        add(f"logger={[k.value for k in kinds]} lacks jsonl: metrics.jsonl is always written, list it "
            "(e.g. logger=[jsonl,tensorboard,wandb])")  # fmt: skip
    repeated = sorted({k.value for k in kinds if kinds.count(k) > 1})
    if repeated:
        add(f"logger lists {repeated} more than once; list each of {', '.join(LoggerKind)} at most once")
    if LoggerKind.wandb in kinds and not cfg.tracker.wandb.project:
        add("tracker.wandb.project must not be empty with logger=[...,wandb] (default: dsv4rl)")
    if LoggerKind.wandb not in kinds and cfg.tracker.wandb != WandbConfig():
        add("tracker.wandb.* is set but logger does not list wandb: nothing would read it; add it "
            "(logger=[jsonl,wandb]) or drop the tracker.wandb keys")  # fmt: skip


def check_run(cfg: Config, add: Add) -> None:
    t, s, eng = cfg.train, cfg.sync, cfg.engine
    if t.steps < 1:
        add(f"train.steps must be >= 1 (got {t.steps})")
    if t.micro_batch_size < 1:
        add(f"train.micro_batch_size must be >= 1 (got {t.micro_batch_size})")
    if t.checkpoint_every < 0:
        add(f"train.checkpoint_every must be >= 0 (got {t.checkpoint_every}; 0: never)")
    if t.keep_checkpoints < 1:
        add(f"train.keep_checkpoints must be >= 1 (got {t.keep_checkpoints})")
    check_loggers(cfg, add)
    if t.log_every < 1:
        add(f"train.log_every must be >= 1 (got {t.log_every})")
    if t.max_nonfinite_steps < 0:
        add(f"train.max_nonfinite_steps must be >= 0 (got {t.max_nonfinite_steps}; 0: stop at the first)")
    for problem in freeze_entry_problems(t.freeze):  # entries matching no tensor: when the trainer builds
        add(problem)
    if s.bucket_bytes <= 0:
        add(f"sync.bucket_bytes must be > 0 (got {s.bucket_bytes})")
    if s.pause_mode not in PAUSE_MODES:
        add(f"sync.pause_mode={s.pause_mode!r} is unknown; choose one of {', '.join(PAUSE_MODES)}")
    if s.timeout_s <= 0:
        add(f"sync.timeout_s must be > 0 (got {s.timeout_s})")
    if not s.group_name:
        add("sync.group_name must not be empty")
    if eng.max_batch_size < 1 or eng.max_concurrency < 1:
        add("engine.max_batch_size and engine.max_concurrency must be >= 1")
    if eng.retries < 0:
        add(f"engine.retries must be >= 0 (got {eng.retries})")
    if eng.max_restarts < 0:
        add(f"engine.max_restarts must be >= 0 (got {eng.max_restarts}; 0: an engine failure stops the run)")
    engines = len(topology(cfg).engines)
    if not 1 <= eng.min_alive <= max(engines, 1):
        add(
            f"engine.min_alive={eng.min_alive} must be between 1 and the run's {engines} engine(s): fewer "
            "engines answering stops the run"
        )
    if eng.health_timeout_s <= 0:
        add(f"engine.health_timeout_s must be > 0 (got {eng.health_timeout_s})")
    if eng.startup_timeout_s <= 0 or eng.request_timeout_s <= 0:
        add("engine.startup_timeout_s and engine.request_timeout_s must be > 0")
    planned = {
        "--admin-api-key": "the planner gives engines an admin key (DSV4RL_ENGINE_ADMIN_API_KEY chooses it)",
        "--api-key": "the planner gives engines an api key (DSV4RL_ENGINE_API_KEY chooses it)",
        "--config": "the planner passes the keys in a --config file, and SGLang takes one",
        "--enable-deterministic-inference": "set engine.reproducible_sampling=true (the client then seeds "
        "every sample; the flag alone makes the samples of a prompt identical)",
        "--dtype": "set engine.dtype",
        "--moe-runner-backend": "the planner chooses SGLang's MoE runner from quant and cluster.device, one "
        "whose weight updates work (docs/weights.md)",
        "--moe-a2a-backend": "the planner's MoE runner table assumes SGLang's default (none)",
    }
    for flag in [a for a in map(str, eng.extra_args) if a.split("=", 1)[0] in planned]:
        add(f"engine.extra_args has {flag}: {planned[flag.split('=', 1)[0]]}; remove it")
    if cfg.parallel.rollout.engine == RolloutEngineKind.sglang and EMULATE_FLAG in map(str, eng.extra_args):
        add(
            f"engine.extra_args has {EMULATE_FLAG}, the reference engine's own flag (SGLang has none and "
            "would not start): remove it, or set parallel.rollout.engine=reference"
        )
    if eng.python is not None and not eng.python.strip():
        add("engine.python is empty: give SGLang's interpreter, or null for this one")
    if not cfg.run.dir:
        add("run.dir must not be empty")
    if cfg.run.step_timeout_s < 0:
        add(f"run.step_timeout_s must be >= 0 (got {cfg.run.step_timeout_s}; 0 turns the hang watchdog off)")
    if cfg.run.stop_grace_s <= 0:
        add(
            f"run.stop_grace_s must be > 0 (got {cfg.run.stop_grace_s}): how long a graceful stop (SIGTERM, "
            "SIGUSR1) may take to end the step and write its checkpoint"
        )
    a = cfg.align
    if a.prompts < 1 or a.samples_per_prompt < 1 or a.worst_tokens < 0:
        add(
            "align.prompts and align.samples_per_prompt must be >= 1 and align.worst_tokens >= 0 "
            f"(got {a.prompts}, {a.samples_per_prompt}, {a.worst_tokens})"
        )
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        add(
            "align.max_new_tokens must be >= 1, or null for algo.sampling.max_new_tokens "
            f"(got {a.max_new_tokens})"
        )
