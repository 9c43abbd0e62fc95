"""The recipe schema: every key a recipe may set, with its type and default.

Recipes are YAML composed by Hydra; the composed tree is merged into these dataclasses
(OmegaConf structured configs), so an unknown key or a wrongly typed value is rejected
before any process starts. Cross-field rules (parallel layouts, sizes) live in
`dsv4rl.checks.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the algo group's classes, re-exported: code and users import every schema class from this module
from dsv4rl.config.algo_schema import AlgoConfig as AlgoConfig
from dsv4rl.config.algo_schema import DynamicSamplingConfig as DynamicSamplingConfig
from dsv4rl.config.algo_schema import MISConfig as MISConfig
from dsv4rl.config.algo_schema import OverlongConfig as OverlongConfig
from dsv4rl.config.algo_schema import OversampleConfig as OversampleConfig
from dsv4rl.config.algo_schema import SamplingConfig as SamplingConfig
from dsv4rl.config.algo_schema import TISConfig as TISConfig
from dsv4rl.config.choices import (
    AlignFeature,
    AttentionImpl,
    ChatFormat,
    ClusterKind,
    CommBackend,
    DeviceKind,
    Dtype,
    EngineNumerics,
    EvalScoredBy,
    EvalSet,
    ExpertScaleDtype,
    GraderName,
    LoggerKind,
    LRSchedule,
    MalformedCall,
    NumericsFeature,
    OptimizerName,
    QuantMode,
    ReasoningEffort,
    RecomputeMode,
    ResumeMode,
    RewardOnError,
    RolloutEngineKind,
    RolloutMode,
    ScaleFormat,
    TitoCheck,
    TrainBackend,
    TruncateSide,
)
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.sglang_choices import PauseMode, SyncLoadFormat


@dataclass
class TrainParallelConfig:
    backend: TrainBackend = TrainBackend.fsdp
    nnodes: int = 1
    nproc_per_node: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    context_parallel: int = 1
    # Layers on the last pipeline stage (null: even split).
    last_stage_layers: int | None = None
    recompute: RecomputeMode = RecomputeMode.none
    recompute_granularity_layers: int = 1
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    precision_aware_optimizer: bool = False
    attention: AttentionImpl = AttentionImpl.auto
    attention_query_chunk: int = 256  # queries per chunk of the sparse attention and of the indexer


@dataclass
class RolloutParallelConfig:
    engine: RolloutEngineKind = RolloutEngineKind.reference
    num_engines: int = 1
    gpus_per_engine: int = 0  # 0 on CPU
    tensor_parallel: int = 1
    expert_parallel: int = 1
    data_parallel: int = 1
    nnodes: int = 0  # nodes given to rollout in a disaggregated layout (0: same nodes as training)
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    watchdog_timeout_s: float = 300.0


@dataclass
class ParallelConfig:
    colocate: bool = False
    train: TrainParallelConfig = field(default_factory=TrainParallelConfig)
    rollout: RolloutParallelConfig = field(default_factory=RolloutParallelConfig)


@dataclass
class CommConfig:
    """Collective backend and the environment preset given to every training and rollout process."""

    name: str = "cpu_gloo"
    backend: CommBackend = CommBackend.gloo
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class QuantConfig:
    """Quantize on send: the trainer converts its weights to the format the engines hold."""

    name: QuantMode = QuantMode.none
    block_size: list[int] = field(default_factory=lambda: [128, 128])  # FP8 tile (out, in)
    scale_fmt: ScaleFormat = ScaleFormat.ue8m0
    # auto: E8M0 for the reference engine (what the checkpoint stores) and for SGLang with aiter on ROCm,
    # float32 for SGLang elsewhere (what each holds; a mismatch is refused at connect time).
    expert_scale_dtype: ExpertScaleDtype = ExpertScaleDtype.auto
    # Environment only the SGLang engines get (merged over comm.env); validation checks it against `name`.
    engine_env: dict[str, str] = field(default_factory=dict)


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: LRSchedule = LRSchedule.constant
    min_lr_ratio: float = 0.1


@dataclass
class ArithDataConfig:
    """Procedural arithmetic problems (tiny_arith)."""

    max_operand: int = 4
    ops: list[str] = field(default_factory=lambda: ["+"])
    max_answer: int = 9


@dataclass
class DataConfig:
    name: str = "tiny_arith"  # tiny_arith | tiny_tool | dapo_math | aime24 | math500 | gsm8k
    path: str | None = None  # jsonl or parquet; null for procedural data
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    shuffle: bool = True
    max_prompt_len: int = 1024
    holdout: int = 0  # the file's last N rows are never trained on (eval=dapo_math_holdout scores them)
    chat_format: ChatFormat = ChatFormat.none
    thinking: bool = False  # deepseek_v4(1): the prompt ends with <think> (reason first) or </think>
    # a DeepSeek chat format with thinking: the named tier; null: the encoder's default
    reasoning_effort: ReasoningEffort | None = None
    # deepseek_v41 with thinking: the effort line's integer budget, 1-100 (SGLang's integer reasoning_effort);
    # null: reasoning_effort's tier
    reasoning_budget: int | None = None
    arith: ArithDataConfig = field(default_factory=ArithDataConfig)


@dataclass
class RewardFnConfig:
    """One reward function of `reward.fns` (docs/tasks.md): the reward is the weighted sum of their scores."""

    name: str = ""  # metrics.jsonl: reward/<name>/score and reward/<name>/<key> of a dict result
    # builtin:<grader> | pkg.module:function | path/to/file.py:function (relative to the recipe's
    # directory, else to the working directory)
    target: str = ""
    weight: float = 1.0  # 0: a logged metric only
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to every call (builtin: grader options)
    timeout_s: float | None = None  # per call; null: reward.timeout_s
    on_error: RewardOnError = RewardOnError.zero
    group: bool = False  # the function takes the G samples of one prompt and returns G results


@dataclass
class RemoteRewardConfig:
    """A reward service: POSTs batches of samples as JSON (docs/reward_contract.md), one result each."""

    url: str = ""  # empty: no remote reward
    name: str = "remote"
    weight: float = 1.0
    batch_size: int = 16  # samples per POST (a group's samples, split)
    timeout_s: float = 60.0  # per POST
    retries: int = 3  # after the first attempt: on connection errors, timeouts and 5xx (never on 4xx)
    max_concurrency: int = 8  # POSTs in flight
    headers: dict[str, str] = field(default_factory=dict)
    on_error: RewardOnError = RewardOnError.zero


@dataclass
class RewardJudgeConfig:
    """A judge model behind an OpenAI-compatible /v1/chat/completions (an SGLang engine the user starts)."""

    base_url: str = ""  # empty: no judge; e.g. http://judge-host:30000 (/v1/chat/completions is appended)
    model: str = "default"  # the served model name
    # Filled with the sample's fields: {prompt} {response} {answer} {reasoning} {ground_truth}, {metadata[x]}
    prompt_template: str = (
        "Rate the response to the task from 0 to 10. Reply with the number only.\n\n"
        "Task: {prompt}\n\nReference answer: {ground_truth}\n\nResponse: {answer}"
    )
    # number: the reply's first number | a regex whose first group (else whole match) is the score |
    # pkg.module:function or file.py:function taking the reply's text and returning a float or None
    parse: str = "number"
    scale: float = 1.0  # the parsed number is multiplied by this (0-10 ratings: 0.1)
    name: str = "judge"
    weight: float = 1.0
    max_concurrency: int = 8  # requests in flight
    rpm: int = 0  # requests per minute (0: no limit)
    tpm: int = 0  # tokens per minute, prompt and completion (0: no limit)
    retries: int = 3  # on connection errors, timeouts, 429 and 5xx
    timeout_s: float = 60.0
    max_tokens: int = 64
    temperature: float = 0.0
    api_key_env: str | None = None  # the environment variable holding the bearer token (never the key)
    on_error: RewardOnError = RewardOnError.zero


@dataclass
class RewardConfig:
    # The short form: one builtin grader with weight 1, used when fns, remote and judge are all unset.
    grader: GraderName = GraderName.arith
    # Default per call: grader pools (math_verify; every grader in eval) and reward.fns without their own
    timeout_s: float = 5.0
    correct: float = 1.0
    incorrect: float = 0.0
    # Worker processes for math_verify, every grader in eval, and reward.fns' sync functions
    num_workers: int = 1
    # A batch where more than this fraction of a function's calls raised stops the run (never train on zeros)
    max_error_fraction: float = 0.05
    # A step where more than this fraction of a function's calls timed out stops the run, as soon as that many
    # have (the step's other calls are cancelled): a reward that always hangs stops the first step
    max_timeout_fraction: float = 0.05
    # The scoring a round has left once its last sample is back (time_reward_s) must end within this many
    # seconds, else the run stops naming the slowest function. 0: no limit. Keep it below run.step_timeout_s
    # (the hang watchdog, which stops the run without naming the function).
    step_timeout_s: float = 600.0
    fns: list[RewardFnConfig] = field(default_factory=list)  # your own reward functions (docs/tasks.md)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)  # a reward service over HTTP
    judge: RewardJudgeConfig = field(default_factory=RewardJudgeConfig)  # a judge model (chat completions)
    async_concurrency: int = 64  # calls of `async def` reward functions in flight at once


@dataclass
class ToolConfig:
    """One tool of `rollout.tools`: `target` is `builtin:python`, `pkg.module:Name` or `file.py:Name` (a
    class implementing dsv4rl.tools.base.Tool, instantiated with `kwargs`, or a plain function)."""

    target: str = ""
    name: str | None = None  # null: the tool's own name
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0  # per call, enforced by the rollout whatever the tool does


@dataclass
class RolloutConfig:
    """How trajectories are generated: one turn, or turns with tool calls / an environment in between.
    Budgets are per trajectory except `max_new_tokens_per_turn` (docs/agents.md)."""

    mode: RolloutMode = RolloutMode.single_turn
    tools: list[ToolConfig] = field(default_factory=list)
    env: str | None = None  # mode env: `pkg.module:Class` / `file.py:Class` (dsv4rl.rollout.env.Env)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4  # assistant turns per trajectory
    max_tool_calls: int = 8  # tool calls per trajectory (past it: finish reason tool_budget)
    max_parallel_calls: int = 4  # one turn's calls run at most this many at once
    max_new_tokens_per_turn: int | None = None  # null: algo.sampling.max_new_tokens
    max_total_tokens: int = 1024  # the whole trajectory after the prompt, inserted tokens included
    max_tool_output_tokens: int = 256  # one call's result, after the template's tokens
    truncate_side: TruncateSide = TruncateSide.middle
    tito_check: TitoCheck = TitoCheck.strict
    on_malformed_call: MalformedCall = MalformedCall.feedback
    max_concurrent_tools: int = 32  # tool calls in flight across all trajectories (the tool pool)
    # More of a step's calls of one tool failed on the tool's side (it raised, or ran past its timeout_s; an
    # environment's step raised): the run stops. The model's own errors (ToolResult(error=True)) do not count.
    max_tool_error_fraction: float = 0.05


@dataclass
class EvalConfig:
    """An eval set (`dsv4rl eval <name>`, and every `every_steps` steps of training)."""

    name: EvalSet = EvalSet.tiny_arith
    # A .jsonl/.parquet file, or "hf:<owner>/<name>" for the Hugging Face hub (needs `datasets` and a network)
    dataset: str | None = None
    grader: GraderName = GraderName.math_verify
    samples_per_problem: int = 8
    k: list[int] = field(default_factory=lambda: [1, 8])  # the pass@k written to metrics.jsonl in training
    every_steps: int = 0  # 0: no periodic evaluation
    holdout: int = 0  # > 0: only the last `holdout` rows of the file (rows training never sees: data.holdout)
    max_problems: int | None = None  # the first N problems only (quick checks)
    prompt_template: str | None = None  # "{problem}" is replaced by the problem text; null: the text alone
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # How the eval's prompts are asked; null: as the recipe's data.chat_format / thinking / reasoning_effort
    # / reasoning_budget
    chat_format: ChatFormat | None = None
    thinking: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    reasoning_budget: int | None = None
    # recipe: graded by the recipe's reward (reward.fns, remote, judge; `dsv4rl eval` with no set named sets
    # it); a response passes when its weighted reward total reaches pass_reward (null: the weight sum of
    # the functions with a positive weight, every function's full score of 1.0)
    scored_by: EvalScoredBy = EvalScoredBy.eval_set
    pass_reward: float | None = None


@dataclass
class TrainNumericsConfig:
    """Straight-through fake quantization in the trainer's forward with SGLang's scale rules (forward: the
    rounded values, backward: identity), so the trainer computes what the engines compute. fsdp only."""

    kv_fp8: bool = False  # KV entries (sliding window and compressed) as SGLang's FP8 cache stores them
    act_fp8: bool = False  # FP8 per-(token, 128) inputs of the FP8 linears (quant=fp8_rollout/fp8_mxfp4)
    # What a bf16 trainer on GPUs does anyway, for the float32 trainer on CPU: the weights SGLang holds in
    # bf16 rounded in the forward, bf16 at module boundaries, the TF32 mHC mix, the router from bf16 input.
    bf16_weights: bool = False
    bf16_activations: bool = False
    mhc_tf32: bool = False
    router_bf16_input: bool = False


@dataclass
class TrainConfig:
    steps: int = 100
    micro_batch_size: int = 64  # sequences per forward/backward
    checkpoint_every: int = 0  # 0: never
    keep_checkpoints: int = 2
    log_every: int = 1  # the supervisor prints a step line every that many steps (metrics.jsonl: all)
    # Optimizer steps with a NaN/Inf loss or gradient norm skipped in a row before the run stops (0: stop at
    # the first); a skipped step leaves weights, optimizer state and lr schedule as they were.
    max_nonfinite_steps: int = 3
    numerics: TrainNumericsConfig = field(default_factory=TrainNumericsConfig)
    # Tensors kept fixed: FreezeGroup names and `glob:` / `re:` patterns on transformers' tensor names
    # (dsv4rl.model.freeze). No gradient, no optimizer state; still synced to the engines and checkpointed.
    freeze: list[str] = field(default_factory=list)


@dataclass
class SyncVerifyConfig:
    """Checks after a weight sync; a failed check stops the run, naming the step and the evidence."""

    # Per-tensor sha256 of what was sent against what the engine holds (the reference engine only: SGLang's
    # checksums cover its internal, dequantized tensors and can never equal the trainer's).
    checksum: bool = False
    # Score fixed token sequences on the engines and the trainer; stop when the mean |diff| exceeds the bound.
    logprob_probe: bool = False
    every_steps: int = 1  # check after every k-th sync (the first sync is always checked)
    probe_sequences: int = 8
    probe_length: int = 32
    max_mean_abs_diff: float | None = None  # null: the bound of the quant mode (dsv4rl.sync.verify)


@dataclass
class SyncConfig:
    bucket_bytes: int = 1 << 30
    group_name: str = "weight_update_group"
    pause_mode: PauseMode = PauseMode.retract
    # One broadcast per bucket instead of one per tensor: a 155-tensor tiny model syncs in half the time
    # (bench/weight_sync.py), and a DeepSeek-V4 bucket of thousands of tensors needs no per-tensor call.
    load_format: SyncLoadFormat = SyncLoadFormat.flattened_bucket
    # The weight-update group's timeout on both ends: the trainer's, and the engines' (the planner passes it
    # to SGLang, whose own default is 30 min).
    timeout_s: float = 600.0
    verify: SyncVerifyConfig = field(default_factory=SyncVerifyConfig)


@dataclass
class EngineConfig:
    # Anything but loopback: the engines get per-run api and admin keys (dsv4rl.engine_client.engine_keys).
    host: str = "127.0.0.1"
    # Engine i of a node listens on port + i (port + 10 * i with attention DP, whose engines also open
    # port + 233 .. port + 240).
    port: int = 30000
    # The interpreter of SGLang engines (their own environment: `make install-sglang` makes .venv-sglang, a
    # ROCm cluster uses its SGLang image's). null: this interpreter. Checked before start: it must import
    # sglang and run the trainer's torch release (both ends of the weight-update group).
    python: str | None = None
    # Reproducible sampling: engines run with --enable-deterministic-inference and every sample is its own
    # request with its own seed (run seed, step, prompt, sample index). false: no seed is sent.
    reproducible_sampling: bool = False
    max_batch_size: int = 256
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    max_concurrency: int = 64  # in-flight /generate requests per engine from the rollout client
    # Once every engine answers (and, in training, the weight-update groups are joined), the trainer or
    # the eval process asks each engine to freeze its garbage collector (POST /freeze_gc, SGLang's API):
    # the objects of its imports and model leave the collector's reach, so a full collection no longer
    # stalls a generate batch.
    freeze_gc: bool = True
    retries: int = 2  # after the first attempt of an idempotent call whose connection broke, or a 502-504
    # An engine that dies (or hangs past run.step_timeout_s) is restarted by its node's supervisor with its
    # command and ports (a free port when another process holds its own), at most this many times per
    # engine and run; its requests go to the others
    # meanwhile and it rejoins the weight-update group at the next sync (docs/faults.md). 0: an engine
    # failure stops the run. Colocated engines are never restarted (they share the trainer's GPUs).
    max_restarts: int = 3
    # Fewer engines answering than this stops the run (the trainer counts every node's).
    min_alive: int = 1
    # How long a failed engine call may wait for the engine's /health_generate before the engine counts as
    # lost (and its requests are sent to the others); also how often, and how long, the supervisor probes
    # SGLang engines while requests are open: two probes in a row unanswered make one hung (docs/faults.md).
    health_timeout_s: float = 10.0
    # SGLang engines' `--dtype` (their activations and unquantized weights). The reference engine computes in
    # float32 on the dequantized weights whatever this says.
    dtype: Dtype = Dtype.bfloat16
    # The reference engine's rounding: `exact` (float32) or `sglang` (SGLang 0.5.23's rounding points,
    # docs/numerics.md). Refused with SGLang engines, which round as their kernels do.
    numerics: EngineNumerics = EngineNumerics.exact
    # With numerics=sglang, only these rounding points (null: every one SGLang applies to the checkpoint).
    numerics_features: list[NumericsFeature] | None = None
    # `--enable-fp32-lm-head` for SGLang engines (fp32 logits instead of bf16); the reference engine with
    # numerics=sglang then leaves its logits unrounded too.
    fp32_lm_head: bool = False
    extra_args: list[str] = field(default_factory=list)


@dataclass
class ClusterConfig:
    kind: ClusterKind = ClusterKind.local
    nnodes: int = 1
    node_rank: int = 0
    gpus_per_node: int = 0  # 0: CPU
    master_addr: str = "127.0.0.1"
    # Hostname or IP of every node, by node rank (multi-node: engine URLs are built from these; the Slurm
    # launch script passes `cluster.node_addrs=[...]` from `scontrol show hostnames`). Empty: one node.
    node_addrs: list[str] = field(default_factory=list)
    master_port: int = 29500
    weight_sync_port: int = 29600
    # Multi-node: a node not heard from this long (its supervisor's heartbeat in <run.dir>/nodes/) stops the
    # nodes that depend on it (dsv4rl.launcher.node_liveness).
    node_timeout_s: float = 60.0
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    # Every node's accelerator: memory, peak FLOPs and links for `dsv4rl plan`'s estimates (cpu: none).
    device: DeviceKind = DeviceKind.cpu
    # Scale-out bandwidth per GPU between nodes, GB/s (the weight sync's wire when engines live on other
    # nodes). null: the NIC of the device's reference platform (dsv4rl.estimate.devices).
    network_gb_per_s: float | None = None
    # A weight push that fails on engines whose post-processing is not idempotent ends the run with exit 76
    # and <run.dir>/FAILED_PUSH; the batch script requeues the job (fresh engines, resume=auto) at most this
    # many times per run dir, counted in <run.dir>/REQUEUES (dsv4rl.faults.failed_push). 0: never.
    max_requeues: int = 3


@dataclass
class WandbConfig:
    """`tracker.wandb.*`: the W&B run's place and labels (`logger=[jsonl,wandb]`)."""

    project: str = "dsv4rl"
    entity: str | None = None  # null: the account's default entity
    name: str | None = None  # null: the run dir's name
    tags: list[str] = field(default_factory=list)
    group: str | None = None


@dataclass
class TrackerConfig:
    """Settings of the experiment trackers that `logger` lists (dsv4rl.trackers)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class AlignConfig:
    """`dsv4rl align`: responses generated by the engines, their log-probs recomputed by the trainer."""

    prompts: int = 32
    samples_per_prompt: int = 4
    max_new_tokens: int | None = None  # null: algo.sampling.max_new_tokens
    worst_tokens: int = 10  # how many of the largest differences the report lists, with context
    # `--attribute`: the features toggled (null: plain align; `--attribute` alone takes every feature that
    # applies to the recipe; dsv4rl.launcher.attribute_run)
    attribute: list[AlignFeature] | None = None


@dataclass
class EstimateConfig:
    """The assumptions of `dsv4rl plan`'s step-time estimate, printed next to it (estimate/step_time.py)."""

    # Generated tokens per second of one rollout engine, all its concurrent requests together.
    engine_tokens_per_s: float = 2000.0
    # Fraction of the training GPUs' peak dense BF16 FLOP/s the trainer reaches on the counted FLOPs
    # (recompute and the old-policy forward included).
    mfu: float = 0.2
    # Mean response length as a fraction of algo.sampling.max_new_tokens.
    response_len_fraction: float = 0.5
    # Mean prompt length in tokens (trained on, not generated).
    mean_prompt_tokens: float = 0.0


@dataclass
class RunConfig:
    dir: str = "runs/default"
    progress: bool = True  # live rich display in the supervisor
    # The hang watchdog: a trainer phase (rollout, train, sync, ...) without progress for this long makes
    # every process dump its Python stacks (logs/stacks-<process>.txt), then the run stops. 0: off.
    step_timeout_s: float = 1800.0
    # Start even when the memory plan (`dsv4rl plan`) says a GPU needs more than the device has.
    force_memory_plan: bool = False
    # SIGTERM/SIGUSR1 to `dsv4rl train` (or a trainer rank): the trainer ends its step, checkpoints and
    # exits; if it has not within this many seconds, every process is stopped at once (docs/faults.md).
    stop_grace_s: float = 600.0
    # Every N steps, each sample of the step to <run.dir>/rollouts/step_<N>.jsonl (prompt, response, ids,
    # log-probs, each reward function's result, advantage): `dsv4rl rollouts RUN_DIR` shows them. 0: off.
    save_rollouts: int = 0


@dataclass
class Config:
    recipe: str = "custom"
    seed: int = 0
    resume: ResumeMode = ResumeMode.false
    run: RunConfig = field(default_factory=RunConfig)
    logger: list[LoggerKind] = field(default_factory=lambda: [LoggerKind.jsonl])
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig | None = None  # no eval set: nothing is evaluated
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    align: AlignConfig = field(default_factory=AlignConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
