"""Every fixed set of choices a recipe key takes (the keys themselves are in `dsv4rl.config.schema`; the
choices that mirror SGLang's own in `dsv4rl.config.sglang_choices`), their base `Choice`, and the one way
to turn an outside value into one (`choice`)."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar


class Choice(StrEnum):
    """A fixed set of choices of the schema. A member prints as its value, in messages too (`{x!r}`
    gives 'aime24', as the recipe spells it)."""

    def __repr__(self) -> str:
        return repr(self.value)


E = TypeVar("E", bound=StrEnum)


def choice(kind: type[E], value: object, key: str) -> E:
    """`value` as one of `kind`'s members, or a ValueError naming `key` and the choices. Code that takes a
    setting from outside a composed recipe (an argument, a request) turns it into the schema's enum here."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is unknown; choose one of {', '.join(kind)}") from None


class Task(Choice):
    """What a run's trainer-side process does (`dsv4rl train`, `dsv4rl align`, `dsv4rl eval`)."""

    train = "train"
    align = "align"  # trainer ranks recompute the engines' log-probs (dsv4rl.train.align)
    eval = "eval"  # one evaluating process in the trainer's place (dsv4rl.eval.worker)


class ProcessRole(Choice):
    """A node supervisor's child: a rollout engine (a server) or the trainer side (watched for progress)."""

    engine = "engine"
    trainer = "trainer"


class ModelArchitecture(Choice):
    """The model family a recipe's model belongs to (`model.architecture`)."""

    deepseek_v4 = "deepseek_v4"
    # DeepSeek-V4.1 (docs/deepseek_v41.md): planned (`dsv4rl plan`); the trainers do not build it yet, so a
    # run of it is refused before any process starts
    deepseek_v41 = "deepseek_v41"


class TrainBackend(Choice):
    fsdp = "fsdp"
    megatron = "megatron"


class FreezeGroup(Choice):
    """The named groups of `train.freeze`: tensors the trainer keeps fixed (dsv4rl.model.freeze). The
    reference run (Miles' DeepSeek-V4 launcher) freezes both: `--moe-router-freeze-gate`,
    `--freeze-e-score-correction-bias`."""

    router_gate = "router_gate"  # every MoE router's gate weight, the hash-routed layers' included
    router_bias = "router_bias"  # the score routers' expert score-correction bias (a buffer in both backends)


class RolloutEngineKind(Choice):
    reference = "reference"  # dsv4rl's CPU reference engine (same HTTP protocol as SGLang)
    sglang = "sglang"


class SyncTransport(Choice):
    """How a weight sync's buckets reach the engines (chosen by `parallel.colocate`)."""

    broadcast = "broadcast"  # /update_weights_from_distributed: a broadcast over the weight-update group
    tensor = "tensor"  # /update_weights_from_tensor: handles to shared memory (CUDA IPC on GPUs), colocated


class MemoryTag(Choice):
    """What an engine gives back in /release_memory_occupation (SGLang 0.5.23's `srt/constants.py`)."""

    kv_cache = "kv_cache"
    weights = "weights"
    cuda_graph = "cuda_graph"


class CommBackend(Choice):
    gloo = "gloo"
    nccl = "nccl"  # RCCL on ROCm builds of torch


class Dtype(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"


class RecomputeMode(Choice):
    none = "none"
    full = "full"
    selective = "selective"


class AttentionImpl(Choice):
    """The trainer's attention core. `sparse`: only the keys DeepSeek-V4 attends to, in query chunks
    (the megatron backend); `dense`: the [S, S + T] reference form; `auto`: sparse on megatron,
    transformers' own (dense, eager) on fsdp."""

    auto = "auto"
    sparse = "sparse"
    dense = "dense"


class EngineNumerics(Choice):
    """How the reference engine rounds (docs/numerics.md); SGLang engines round as their kernels do."""

    exact = "exact"  # float32 on the dequantized weights
    sglang = "sglang"  # SGLang 0.5.23's DeepSeek-V4 rounding points, emulated on the float32 model


class NumericsFeature(Choice):
    """One rounding point of SGLang's DeepSeek-V4 forward that `engine.numerics=sglang` reproduces."""

    bf16_weights = "bf16_weights"  # the weights SGLang holds: bf16 where the release keeps bf16
    bf16_activations = "bf16_activations"  # bf16 at module boundaries, fp32 inside norms/RoPE/softmax/mHC
    kv_fp8 = "kv_fp8"  # FP8 KV cache: nope dims e4m3 with a UE8M0 scale per 64 dims, rope dims bf16
    act_fp8 = "act_fp8"  # FP8 per-(token, 128-channel) inputs of the FP8 linears (FP8 checkpoints only)
    mhc_tf32 = "mhc_tf32"  # the mHC mixing projection on TF32 operands
    router_bf16_input = "router_bf16_input"  # router logits in fp32 from bf16 hidden states
    bf16_logits = "bf16_logits"  # bf16 LM head output (off with engine.fp32_lm_head)


class AlignFeature(Choice):
    """A knob that brings the trainer's log-probs to the engine's, toggled by `dsv4rl align --attribute`."""

    routing_replay = "routing_replay"  # algo.routing_replay: the engine's experts in score-routed layers
    indexer_replay = "indexer_replay"  # algo.indexer_replay: the engine's CSA indexer top-k
    fp32_lm_head = "fp32_lm_head"  # engine.fp32_lm_head: the engine's logits unrounded
    kv_fp8 = "kv_fp8"  # train.numerics.kv_fp8: the trainer's KV entries as SGLang's FP8 cache holds them
    act_fp8 = "act_fp8"  # train.numerics.act_fp8: the trainer's FP8-linear inputs as SGLang quantizes them
    bf16_weights = "bf16_weights"  # train.numerics.bf16_weights: the weights SGLang holds in bf16
    bf16_activations = "bf16_activations"  # train.numerics.bf16_activations: bf16 at module boundaries
    mhc_tf32 = "mhc_tf32"  # train.numerics.mhc_tf32: the mHC mixing projection on TF32 operands
    router_bf16_input = "router_bf16_input"  # train.numerics.router_bf16_input: router from bf16 input


class QuantMode(Choice):
    """The weight format on the wire, which is also the format of the checkpoint the engines serve."""

    none = "none"  # the trainer's own dtype (an unquantized checkpoint)
    bf16 = "bf16"  # BF16 tensors, FP32 where the release keeps FP32
    fp8_rollout = "fp8_rollout"  # FP8 e4m3 128x128 blocks for the quantized linears and the routed experts
    fp8_mxfp4 = "fp8_mxfp4"  # the released checkpoint: FP8 blocks, routed experts MXFP4 (e2m1, 1x32 scales)

    @property
    def quantized(self) -> bool:
        """Whether the mode sends quantized tensors with scales (an FP8 checkpoint on the engines)."""
        return self in (QuantMode.fp8_rollout, QuantMode.fp8_mxfp4)


class ExportFormat(Choice):
    """`dsv4rl export --format`: the tensor names of the model directory written (docs/export.md)."""

    native = "native"  # the release's names, dtypes and scales: SGLang loads it (transformers: unquantized)
    hf = "hf"  # transformers' own names (stacked experts), unquantized: what `save_pretrained` writes


class ScaleFormat(Choice):
    ue8m0 = "ue8m0"  # power-of-two block scales (the only rule DeepSeek-V4's kernels use)


class ExpertScaleDtype(Choice):
    """The dtype of routed-expert scales on the wire; `auto` takes the one the engine holds."""

    auto = "auto"
    float8_e8m0fnu = "float8_e8m0fnu"
    float32 = "float32"


class LossAggregation(Choice):
    token_mean = "token_mean"  # DAPO: every token of the batch weighs the same
    seq_mean_token_mean = "seq_mean_token_mean"  # original GRPO: mean per sequence, then over sequences
    seq_mean_token_sum = "seq_mean_token_sum"  # Dr.GRPO-style constant normaliser


class KLEstimator(Choice):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"  # low-variance estimator


class AlgorithmName(Choice):
    """The recipe's algorithm family (its `algo` group); the loss reads the individual keys it sets."""

    grpo = "grpo"
    dapo = "dapo"


class OptimizerName(Choice):
    adamw = "adamw"  # Adam with decoupled weight decay (megatron-core's "adam" optimizer is this too)


class LRSchedule(Choice):
    constant = "constant"
    cosine = "cosine"  # after warmup, decay to lr * min_lr_ratio at the last optimizer step


class ResumeMode(Choice):
    """`resume=`: what a run does with the checkpoints already in its run dir. Reads like the bool it
    replaces (`if cfg.resume:` is true for `true` and `auto`); `resume=true/false` still parse."""

    false = "false"  # a fresh run; refused when run.dir holds one
    true = "true"  # continue from the newest checkpoint (a notice, then a fresh start, when there is none)
    auto = "auto"  # continue when there is a checkpoint, start fresh when there is none (requeued jobs)

    def __bool__(self) -> bool:
        return self is not ResumeMode.false


class LoggerKind(Choice):
    """Where a run's per-step metrics go (`logger=[...]`): metrics.jsonl always, the trackers when listed."""

    jsonl = "jsonl"  # <run.dir>/metrics.jsonl (always written)
    tensorboard = "tensorboard"  # event files under <run.dir>/tensorboard
    wandb = "wandb"  # Weights & Biases; offline (under <run.dir>/wandb) unless credentials are set


class GraderName(Choice):
    arith = "arith"
    dapo = "dapo"  # "Answer: X" on the last line, DAPO's rule
    answer_line = "answer_line"
    boxed = "boxed"
    math_verify = "math_verify"


class RolloutMode(Choice):
    """How a trajectory is generated (docs/agents.md)."""

    single_turn = "single_turn"  # one response per prompt (no tools)
    tools = "tools"  # generate, run the tool calls, append the results, generate again
    env = "env"  # a user environment (`rollout.env`) answers each assistant turn


class TitoCheck(Choice):
    """What a chat render that is not append-only (the earlier render not a prefix of the later) does."""

    strict = "strict"  # the trajectory ends with finish reason `abort` (counted in tool/tito_mismatches)
    warn = "warn"  # logged and counted; the model's own tokens are kept, the render's tail appended


class MalformedCall(Choice):
    """What a malformed tool call (bad syntax, unknown tool, arguments not matching the schema) does."""

    feedback = "feedback"  # the error goes back to the model as that call's result
    terminate = "terminate"  # the trajectory ends there (finish reason `abort`)


class TruncateSide(Choice):
    """Which part of a tool output longer than `rollout.max_tool_output_tokens` is kept."""

    left = "left"  # the beginning
    right = "right"  # the end (a traceback's last lines)
    middle = "middle"  # the beginning and the end, the middle cut


class SandboxIsolation(Choice):
    """What isolates `builtin:python`'s code (its `isolation` kwarg; docs/agents.md says what each mode
    guarantees). Decided at validation; a mode that cannot give its guarantees here is refused."""

    auto = "auto"  # namespaces where they work, else landlock; refused where neither gives every guarantee
    namespaces = "namespaces"  # net, mount and pid namespaces (unshare), a uid of its own, a cgroup per call
    landlock = "landlock"  # Landlock + seccomp + a uid of its own (root) or Landlock scoping, a cgroup a call
    remote = "remote"  # a SandboxFusion service over HTTP (its `remote` kwarg): the service isolates
    rlimits = "rlimits"  # limits and cleanup only: needs trust_model_code=true


class RewardOnError(Choice):
    """What a reward function's call that raised, timed out or returned something unusable is worth."""

    fail = "fail"  # stop the run, naming the function, the sample and where it raised
    zero = "zero"  # a score of 0 (a builtin grader: its `incorrect` value), counted in the metrics
    exclude = "exclude"  # no score from this function for that sample, as if it returned None


class RolloutSort(Choice):
    """`dsv4rl rollouts --sort`: the order the samples of a step are shown in."""

    reward = "reward"  # the total reward (best first; the worst are shown too)
    length = "length"  # the response's length in tokens (longest first)


class ChatFormat(Choice):
    """How a problem becomes the prompt the model sees (`dsv4rl.data.chat_format`)."""

    none = "none"  # BOS + the problem's text, as a base model reads it
    deepseek_v4 = "deepseek_v4"  # DeepSeek-V4's chat encoding, rendered by deepseek-recipe (SGLang's "dsv4")
    # DeepSeek-V4.1's (SGLang's "dsv41"): a <｜System｜> turn, an integer effort line, " calls" DSML tags
    deepseek_v41 = "deepseek_v41"


class ReasoningEffort(Choice):
    """deepseek-recipe 0.2.0's reasoning-effort tiers (its `ReasoningEffort`); thinking mode only. The
    DeepSeek-V4.1 encoding renders each as a budget (low 50, high and xhigh 75, max 100); any other budget
    is `data.reasoning_budget`."""

    low = "low"  # no preamble (DeepSeek-V4)
    high = "high"  # the encoder's default in thinking mode
    xhigh = "xhigh"  # rendered as `high` by the DeepSeek-V4 encoding
    max = "max"


class EvalSet(Choice):
    """The eval sets dsv4rl reads (`dsv4rl.eval.data`); `eval: null` (the `eval=none` option) runs none."""

    tiny_arith = "tiny_arith"  # every a+b problem of the tiny model (procedural)
    aime24 = "aime24"
    math500 = "math500"
    gsm8k = "gsm8k"
    dapo_math_holdout = "dapo_math_holdout"  # the last rows of DAPO-Math-17K, held out of training


class EvalScoredBy(Choice):
    """What grades an eval (docs/eval.md): the eval set's `eval.grader`, or the recipe's own reward."""

    eval_set = "eval_set"  # `dsv4rl eval <set>`: the set's grader and sampling
    recipe = "recipe"  # `dsv4rl eval recipe=...` (no set named): reward.fns and algo.sampling's caps


class ClusterKind(Choice):
    local = "local"
    slurm = "slurm"


class DeviceKind(Choice):
    """The accelerator of every node; `dsv4rl plan` sizes memory and step time against its data sheet
    (`dsv4rl.estimate.devices`). cpu: nothing is estimated."""

    cpu = "cpu"
    mi355x = "mi355x"
    mi300x = "mi300x"
    mi325x = "mi325x"
    h100 = "h100"
    h200 = "h200"
