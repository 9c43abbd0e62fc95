"""Rules for routing and indexer replay (algo.routing_replay, algo.indexer_replay): refuse a recipe where
a replay has nothing to replay or cannot be carried out, before any process starts. Both trainer backends
replay at every layout they take (megatron refuses context parallelism on its own). Which GPU families
SGLang returns the indexer's top-k on is a row of `dsv4rl.checks.sglang_families`."""

from __future__ import annotations

from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import RolloutEngineKind
from dsv4rl.config.schema import Config

_CSA = "compressed_sparse_attention"


def check_replay(cfg: Config, add: Add) -> None:
    algo = cfg.algo
    if not (algo.routing_replay or algo.indexer_replay):
        return
    if cfg.model.path is None:  # the tiny model: its layer kinds are in the recipe
        tiny = cfg.model.tiny
        if algo.routing_replay and "moe" not in tiny.mlp_layer_types:
            add(
                "algo.routing_replay=true but model.tiny.mlp_layer_types has no score-routed layer ('moe'): "
                "hash-routed layers choose by token id and need no replay; turn it off or add a 'moe' layer"
            )
        if algo.indexer_replay and _CSA not in tiny.layer_types:
            add(
                f"algo.indexer_replay=true but model.tiny.layer_types has no {_CSA!r} layer, so there is no "
                "indexer top-k to replay; turn it off or add a CSA layer"
            )
    ro = cfg.parallel.rollout
    if (
        algo.indexer_replay
        and ro.engine == RolloutEngineKind.sglang
        and ro.tensor_parallel != ro.data_parallel
    ):
        # IndexerTopkCapturer asserts attn_tp_size == 1 (SGLang 0.5.23 state_capturer/indexer_topk.py:32-33)
        add(
            f"algo.indexer_replay=true needs SGLang's attention TP size 1 (attention DP over the whole TP "
            f"group), but parallel.rollout.tensor_parallel={ro.tensor_parallel} with data_parallel="
            f"{ro.data_parallel}: set parallel.rollout.data_parallel={ro.tensor_parallel} or turn it off"
        )
