"""Rules about this machine and network: paths that must exist, reachable addresses, what the model
directory allows.

`check_paths` and `check_model_layout` read the filesystem, so `validate` runs them only with
`check_paths=True`; `check_cluster_addresses` reads only the recipe and always runs.
"""

from __future__ import annotations

from pathlib import Path

from dsv4rl.checks.parallel import check_megatron_heads
from dsv4rl.checks.problems import Add
from dsv4rl.config.schema import Config, TrainBackend
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
    if c.nnodes > 1 and cfg.engine.host in LOOPBACK and not on_one_machine(cfg):
        add(
            f"engine.host={cfg.engine.host} binds loopback only, but with cluster.nnodes={c.nnodes} trainer "
            f"rank 0 on node 0 reaches the engines on {_engine_nodes_text(cfg)} through "
            "cluster.node_addrs: set engine.host=0.0.0.0"
        )


def check_model_layout(cfg: Config, add: Add) -> None:
    """What only the model directory tells: the Megatron engine splits its heads and output groups."""
    if cfg.parallel.train.backend != TrainBackend.megatron or cfg.model.path is None:
        return
    if not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        return  # check_paths names the missing directory (and nothing imports torch for it)
    from dsv4rl.model.native_checkpoint import CheckpointError, read_config  # torch: only when needed

    try:
        config = read_config(cfg.model.path)
    except (CheckpointError, OSError, ValueError):
        return  # check_paths reports an unreadable model directory
    heads = config.get("num_attention_heads", config.get("n_heads"))
    if heads is not None and "o_groups" in config:
        tensor_parallel = cfg.parallel.train.tensor_parallel
        check_megatron_heads(tensor_parallel, heads, config["o_groups"], cfg.model.path, add)


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
    path_like = tok != "arith_chars" and tok != m.path and tok.startswith(("/", ".", "~"))
    if path_like and not Path(tok).expanduser().is_dir():
        add(f"model.tokenizer {tok!r} does not exist: pass model.tokenizer=<tokenizer directory>")
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
