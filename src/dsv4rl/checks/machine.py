"""Rules about this machine and network: paths that must exist, reachable addresses, what the model
directory allows, what the trainer's environment has installed.

`check_paths`, `check_model_layout` and `check_transformer_engine` read the filesystem or the
environment, so `validate` runs them only with `check_paths=True`; `check_cluster_addresses` reads only
the recipe and always runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4rl.checks.parallel import check_megatron_heads
from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import ChatFormat, ModelArchitecture, RolloutEngineKind, TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.model.release_config import model_type_problem, release_key_problems, sglang_problems
from dsv4rl.model.tokenizer_files import (
    ARITH_CHARS,
    BUILT_TOKENIZERS,
    CHAT_TOKENS,
    DEEPSEEK_V4,
    V41_CHAT_TOKENS,
    has_tokenizer,
    tokenizer_dir_problems,
)
from dsv4rl.topology import LOOPBACK, engine_nodes, on_one_machine

NODE_ADDRS_FIX = (
    "pass cluster.node_addrs=[host0,host1,...] (every node's hostname or IP, in node-rank order; "
    "launch/slurm/dapo_math_4node.sbatch passes it from `scontrol show hostnames`)"
)


def _engine_nodes_text(cfg: Config) -> str:
    nodes = engine_nodes(cfg)
    return f"nodes {nodes.start}..{nodes.stop - 1}"


def check_cluster_addresses(cfg: Config, add: Add) -> None:
    """Multi-node: engine URLs are `http://<cluster.node_addrs[node]>:<port>`, so engines must bind a
    non-loopback address (unless every node is this machine) and node_addrs (when given; required by the
    path checks) must name every node."""
    c = cfg.cluster
    if c.node_addrs and len(c.node_addrs) != c.nnodes:
        add(
            f"cluster.node_addrs lists {len(c.node_addrs)} address(es) but cluster.nnodes={c.nnodes}: "
            f"{NODE_ADDRS_FIX}"
        )
    if any(not a.strip() for a in c.node_addrs):
        add(f"cluster.node_addrs has an empty entry ({list(c.node_addrs)}); {NODE_ADDRS_FIX}")
    if c.node_timeout_s <= 0:
        add(f"cluster.node_timeout_s must be > 0 seconds (got {c.node_timeout_s:g}), e.g. 60")
    if c.max_requeues < 0:
        add(f"cluster.max_requeues must be >= 0 (got {c.max_requeues}; 0: a failed push is never requeued)")
    if c.nnodes > 1 and cfg.engine.host in LOOPBACK and not on_one_machine(cfg):
        add(
            f"engine.host={cfg.engine.host} binds loopback only, but with cluster.nnodes={c.nnodes} trainer "
            f"rank 0 on node 0 reaches the engines on {_engine_nodes_text(cfg)} through "
            "cluster.node_addrs: set engine.host=0.0.0.0"
        )


TRANSFORMER_ENGINE_FIX = (
    "install Transformer Engine in the trainer's environment (CUDA: `make install GPU=1` does; ROCm: "
    "ROCm's TransformerEngine build, docs/megatron.md) or set parallel.train.precision_aware_optimizer=false"
)


def transformer_engine_problem(cfg: Config) -> str | None:
    """What `precision_aware_optimizer` needs from this environment on a GPU, if it is missing.

    megatron-core's optimizer config reads Transformer Engine's version for it and, without TE, compares
    None with a version: a TypeError on every rank once the job has started
    (`megatron/core/optimizer/optimizer_config.py:383`, `megatron/core/utils.py:348`); without CPU
    offload it also takes TE's FusedAdam."""
    t = cfg.parallel.train
    if t.backend != TrainBackend.megatron or not t.precision_aware_optimizer:
        return None
    try:  # TE loads its CUDA libraries on import: a broken build raises more than ImportError
        import transformer_engine  # noqa: F401

        if not t.optimizer_cpu_offload:
            from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except Exception as exc:
        return (
            "parallel.train.precision_aware_optimizer=true needs Transformer Engine (megatron-core builds "
            f"its optimizer with it), and it does not import here ({type(exc).__name__}: {exc}): "
            f"{TRANSFORMER_ENGINE_FIX}"
        )
    return None


# The device nodes a GPU runtime opens (NVIDIA's driver, ROCm's kernel driver): where neither exists torch
# sees no GPU, and a machine that only plans a GPU recipe is spared importing torch (seconds) to learn it.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


def gpu_visible() -> bool:
    """Whether torch sees a GPU here (CUDA or ROCm), importing torch only where a driver's node exists."""
    if not any(Path(node).exists() for node in GPU_DEVICE_NODES):
        return False
    import torch

    return torch.cuda.is_available()


def check_transformer_engine(cfg: Config, add: Add) -> None:
    """On a node that trains with megatron's distributed optimizer (GPUs), what it needs must import.
    Not on a CPU machine: there the megatron backend steps with torch's AdamW and never builds it."""
    t, c = cfg.parallel.train, cfg.cluster
    if t.backend != TrainBackend.megatron or not t.precision_aware_optimizer or c.gpus_per_node == 0:
        return
    if c.node_rank >= t.nnodes:
        return  # a rollout-only node (trainer nodes come first) starts no trainer
    if not gpu_visible():
        return
    problem = transformer_engine_problem(cfg)
    if problem is not None:
        add(problem)


def check_buildable_model(cfg: Config, add: Add) -> None:
    """A run needs its model built in the trainers: DeepSeek-V4.1 is planned (`dsv4rl plan`, which shows
    this refusal as what `dsv4rl train` would stop on) but not yet built, so its runs stop here."""
    if cfg.model.architecture == ModelArchitecture.deepseek_v41:
        add(
            "model.architecture=deepseek_v41: dsv4rl's trainers do not build DeepSeek-V4.1 yet (its ratio-1 "
            "and ratio-2 attention with shared compressors and indexers, the candidate pool, FP4 indexing, "
            "the lagged mHC and Engram; docs/deepseek_v41.md has what is built and what is not), so no run "
            "of it can start; `dsv4rl plan` sizes a cluster for it. Until then train DeepSeek-V4 "
            "(model=deepseek_v4_flash)"
        )


def check_model_layout(cfg: Config, add: Add) -> None:
    """What only the model directory tells: whether its release keys state the model transformers' keys do
    (and, for SGLang engines, whether SGLang builds that model from them: `dsv4rl.model.release_config`),
    and how the Megatron engine splits its heads and output groups."""
    if cfg.model.path is None:
        return
    if not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        return  # check_paths names the missing directory (and nothing imports torch for it)
    try:
        config = json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return  # check_paths reports an unreadable model directory
    source = f"model.path {cfg.model.path!r}"
    unbuilt = model_type_problem(config)
    if unbuilt is not None:
        add(f"{source}: {unbuilt}")
        return  # the checks below read DeepSeek-V4's keys
    for problem in release_key_problems(config):
        add(f"{source}: its config.json's release keys and transformers' keys disagree: {problem}")
    if cfg.parallel.rollout.engine == RolloutEngineKind.sglang:
        for problem in sglang_problems(config):
            add(f"{source} served by SGLang: {problem}")
    if cfg.parallel.train.backend != TrainBackend.megatron:
        return
    heads = config.get("num_attention_heads", config.get("n_heads"))
    if heads is not None and "o_groups" in config:
        tensor_parallel = cfg.parallel.train.tensor_parallel
        check_megatron_heads(tensor_parallel, heads, config["o_groups"], cfg.model.path, add)


def check_chat_tokenizer_files(cfg: Config, add: Add) -> None:
    """The tokenizer a run loads (model.path's own wins) has the chat tokens its chat formats need
    (DeepSeek-V4.1's adds <｜System｜>), and agrees with the packaged one under
    model.tokenizer=deepseek_v4."""
    m = cfg.model
    formats = {cfg.data.chat_format, cfg.eval.chat_format if cfg.eval else None} - {None, ChatFormat.none}
    chat, v41 = bool(formats), ChatFormat.deepseek_v41 in formats
    if m.path is not None and has_tokenizer(Path(m.path).expanduser()):
        directory = Path(m.path).expanduser()
    elif m.tokenizer not in BUILT_TOKENIZERS and Path(m.tokenizer).expanduser().is_dir():
        directory = Path(m.tokenizer).expanduser()
    else:
        if v41 and m.tokenizer in (ARITH_CHARS, DEEPSEEK_V4):
            keys = [f"{where}.chat_format" for where, section in (("data", cfg.data), ("eval", cfg.eval))
                    if section is not None and section.chat_format == ChatFormat.deepseek_v41]  # fmt: skip
            add(
                f"{'/'.join(keys)}=deepseek_v41 opens every prompt with DeepSeek-V4.1's <｜System｜> token, "
                f"which model.tokenizer={m.tokenizer} has not: use the V4.1 checkpoint's own tokenizer "
                "(model.path with its tokenizer.json, or model.tokenizer=<that directory>), "
                "model.tokenizer=arith_chars_v41 for the tiny model, or chat_format=deepseek_v4"
            )
        return  # the built tokenizers carry their chat tokens
    chat_tokens = V41_CHAT_TOKENS if v41 else CHAT_TOKENS
    model = "DeepSeek-V4.1" if v41 else "DeepSeek-V4"
    for problem in tokenizer_dir_problems(directory, chat, m.tokenizer == DEEPSEEK_V4, chat_tokens):
        add(
            f"{problem}: data.chat_format={'/'.join(sorted(formats)) or 'none'} and "
            f"model.tokenizer={m.tokenizer} need {model}'s tokenizer; point model.path at a {model} "
            "checkpoint, or use chat_format=none / model.tokenizer=<that directory>"
        )


def check_paths(cfg: Config, add: Add) -> None:
    m = cfg.model
    if m.path is not None:
        path = Path(m.path).expanduser()
        if not path.is_dir():
            add(
                f"model.path {m.path!r} does not exist (resolved: {path.resolve()}): download the model, a "
                "Hugging Face directory with config.json, and pass model.path=<that directory>"
            )
        elif not (path / "config.json").is_file():
            add(
                f"model.path {m.path!r} has no config.json: point model.path at a Hugging Face "
                "model directory"
            )
    tok = m.tokenizer
    path_like = tok not in BUILT_TOKENIZERS and tok != m.path and tok.startswith(("/", ".", "~"))
    if path_like and not Path(tok).expanduser().is_dir():
        add(f"model.tokenizer {tok!r} does not exist: pass model.tokenizer=<tokenizer directory>")
    check_chat_tokenizer_files(cfg, add)
    if cfg.data.path is not None and not Path(cfg.data.path).expanduser().is_file():
        add(
            f"data.path {cfg.data.path!r} does not exist (resolved: {Path(cfg.data.path).resolve()}): pass "
            "data.path=<jsonl or parquet file> or set DSV4RL_DATA_DIR to the data directory"
        )
    e = cfg.eval
    local = e is not None and e.dataset is not None and not e.dataset.startswith("hf:")  # hf: the hub
    if local and not Path(e.dataset).expanduser().is_file():
        add(
            f"eval.dataset {e.dataset!r} does not exist (resolved: {Path(e.dataset).resolve()}): pass "
            "data.path=<file> (dsv4rl eval) or eval.dataset=<file>, set DSV4RL_DATA_DIR, or use eval=none"
        )
    c = cfg.cluster
    if c.nnodes > 1 and c.master_addr in LOOPBACK and not on_one_machine(cfg):
        add(
            f"cluster.master_addr={c.master_addr} is a loopback address but cluster.nnodes={c.nnodes}: "
            "set cluster.master_addr=<node 0 host> (or export MASTER_ADDR)"
        )
    if c.nnodes > 1 and not c.node_addrs:
        add(
            f"cluster.node_addrs is empty but cluster.nnodes={c.nnodes}: trainer rank 0 on node 0 reaches "
            f"the engines on {_engine_nodes_text(cfg)} at their node's address; {NODE_ADDRS_FIX}"
        )
    loopback = [a for a in c.node_addrs if a in LOOPBACK]
    if c.nnodes > 1 and loopback and not on_one_machine(cfg):
        add(
            f"cluster.node_addrs has loopback address(es) {loopback} but cluster.nnodes={c.nnodes}: other "
            "nodes cannot reach them; give each node's hostname or IP (only when every address is loopback "
            "do all nodes run on this machine)"
        )
