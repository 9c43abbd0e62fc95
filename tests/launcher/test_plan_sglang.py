"""Every SGLang command `dsv4rl plan` writes, parsed by SGLang 0.5.23's own parser (`prepare_server_args`,
what `python -m sglang.launch_server` runs: argument groups, the `--config` file, the model hooks of
`ServerArgs.__post_init__`) in SGLang's interpreter, with the SGLANG_* environment the planner gives each
engine. Each must parse, and the parsed arguments must hold what dsv4rl meant: the layout, the dtype,
the MoE runner backend of `quant/sglang_moe.py`'s table, memory, the keys from the run's keys file,
the replay returns. The model path is a model directory dsv4rl wrote in the recipe's checkpoint format
(SGLang's hooks read its config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsv4rl.cli import app
from dsv4rl.config.choices import ModelArchitecture, QuantMode
from dsv4rl.config.compose import compose
from dsv4rl.config.schema import QuantConfig
from dsv4rl.engine_client.engine_keys import ensure_engine_keys_file, read_engine_keys
from dsv4rl.model.model_dir import materialize_model
from sglang_runner import needs_sglang

pytestmark = [*needs_sglang, pytest.mark.slow]

TINY_ON_SGLANG = [
    "parallel.rollout.engine=sglang", "model=tiny_dsv4_sglang", "cluster.device=h200",
    "cluster.gpus_per_node=2", "parallel.rollout.gpus_per_engine=1", "sync.verify.checksum=false",
]  # fmt: skip
# (recipe, overrides): the cluster recipe on both device families in every quant mode SGLang takes
# updates in, with the layouts and features that change the command; the tiny recipe on SGLang engines.
PLANS = [
    *[("dapo_math", [f"cluster.device={device}", f"quant={quant}", *extra])
      for device in ("mi355x", "h200")
      for quant in ("none", "bf16", "fp8_rollout")
      for extra in ([], ["parallel.rollout.data_parallel=4", "parallel.rollout.expert_parallel=1"])],
    ("dapo_math", ["algo.routing_replay=true", "engine.fp32_lm_head=true"]),
    ("dapo_math", ["cluster.device=h200", "parallel.rollout.data_parallel=8",
                   "parallel.rollout.expert_parallel=1", "algo.indexer_replay=true"]),
    ("dapo_math", ["engine.reproducible_sampling=true"]),
    ("dapo_math", ["algo.max_staleness=2", "sync.pause_mode=in_place"]),
    *[("tiny_arith", [*TINY_ON_SGLANG, f"quant={quant}", *extra])
      for quant, extra in (("none", ["engine.dtype=float32"]), ("bf16", []),
                           ("fp8_rollout", ["engine.host=0.0.0.0"]))],
    ("dapo_math_v41", []),  # DeepSeek-V4.1 (planned only): its model directory is V4.1's nested config
    ("dapo_math_v41_h200", []),
]  # fmt: skip
CHECKPOINT = {
    "none": "none",
    "bf16": "bf16",
    "fp8_rollout": "fp8_mxfp4",
}  # dapo_math starts from MXFP4 experts


def _model_dirs(tmp: Path) -> dict[str, str]:
    model = compose("tiny_arith", ["model=tiny_dsv4_sglang"]).model
    return {
        quant: materialize_model(model, str(tmp / f"model_{stored}"), QuantConfig(name=QuantMode(stored)))
        for quant, stored in CHECKPOINT.items()
    }


def _v41_model_dir(v4_dir: str, tmp: Path) -> str:
    """A config-only DeepSeek-V4.1 directory (what SGLang's argument hooks read): the tiny V4 config nested
    under `text_config` as V4.1 ships it, with V4.1's layer kinds (ratios 0, 2, 2, 1, 1; KV and index
    sources 1 and 3), no hash layers and no head norm."""
    text = json.loads((Path(v4_dir) / "config.json").read_text())
    for key in ("architectures", "model_type", "layer_types", "mlp_layer_types", "compress_rates"):
        text.pop(key, None)
    text.update(
        model_type="deepseek_v41_text", num_hidden_layers=5, compress_ratios=[0, 2, 2, 1, 1],
        num_hash_layers=0, kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3], q_head_norm=False,
        hc_pre_from_prev_sublayer=True,
    )  # fmt: skip
    directory = tmp / "model_v41"
    directory.mkdir()
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def _planned(recipe: str, overrides: list[str], run_dir: Path, model_dir: str) -> tuple[dict, list[str]]:
    args = [f"recipe={recipe}", *overrides, f"run.dir={run_dir}", f"model.path={model_dir}"]
    if recipe == "dapo_math":  # the commands are the subject here, not whether each layout fits in memory
        args.append("run.force_memory_plan=true")
    result = CliRunner().invoke(app, ["plan", *args, "--all-nodes", "--skip-engine-check", "--json"])
    assert result.exit_code == 0, result.output[-3000:]
    return json.loads(result.stdout), args


def test_sglang_parses_every_planned_engine_command(tmp_path: Path, sglang_sides) -> None:
    models = _model_dirs(tmp_path)
    commands, meant = [], []
    for index, (recipe, overrides) in enumerate(PLANS):
        run_dir = tmp_path / f"run{index}"
        run_dir.mkdir()
        keys = read_engine_keys(ensure_engine_keys_file(run_dir, env={}))  # as `dsv4rl train` makes it
        quant = next((o.split("=")[1] for o in overrides if o.startswith("quant=")), None)
        cfg = compose(recipe, overrides)
        model_dir = models[quant or cfg.quant.name.value]
        v41 = cfg.model.architecture == ModelArchitecture.deepseek_v41
        if v41:
            if "v41" not in models:
                models["v41"] = _v41_model_dir(model_dir, tmp_path)
            model_dir = models["v41"]
        plan, args = _planned(recipe, overrides, run_dir, model_dir)
        cfg = compose(recipe, args[1:])
        engines = [p for node in plan["nodes"] for p in node["processes"] if p["role"] == "engine"]
        assert engines, f"{recipe} {overrides}: no engine planned"
        for process in engines:
            argv = process["argv"]
            assert argv[1:3] == ["-m", "sglang.launch_server"]
            env = {k: v for k, v in process["env"].items() if k.startswith("SGLANG_")}
            commands.append({"argv": argv[3:], "env": env})
            rollout = cfg.parallel.rollout
            meant.append({
                "model_path": model_dir, "port": int(process["port"]),
                "tp_size": rollout.tensor_parallel, "ep_size": rollout.expert_parallel, "dp_size": 1,
                "attn_dp_size": rollout.data_parallel, "base_gpu_id": int(process["gpus"].split("..")[0]),
                "dtype": cfg.engine.dtype.value, "moe_runner_backend": process["moe"]["moe_runner_backend"],
                "mem_fraction_static": rollout.mem_fraction_static,
                "max_running_requests": rollout.max_running_requests,
                "watchdog_timeout": rollout.watchdog_timeout_s,
                "enable_return_routed_experts": cfg.algo.routing_replay,
                "enable_return_indexer_topk": cfg.algo.indexer_replay,
                "enable_fp32_lm_head": cfg.engine.fp32_lm_head,
                "enable_deterministic_inference": cfg.engine.reproducible_sampling,
                "disable_radix_cache": "algo.max_staleness=2" in overrides,  # with in_place (planned so)
                # V4.1's serving shortcut off for RL (False); V4's left alone (None: on a GPU SGLang's V4.1
                # hook would resolve an unset value to on, arg_groups/deepseek_v4_hook.py:415-431)
                "enable_decoder_swa_bounded_replay": False if v41 else None,
                **({"api_key": keys.api_key, "admin_api_key": keys.admin_api_key}
                   if cfg.engine.host not in ("127.0.0.1", "localhost") else {"admin_api_key": None}),
                "label": f"{recipe} {' '.join(overrides)} {process['name']}",
            })  # fmt: skip
    parsed = sglang_sides.get().call("server_args:parse", commands=commands)
    assert len(parsed) == len(meant) >= 20
    for seen, want in zip(parsed, meant, strict=True):
        label = want.pop("label")
        for key, value in want.items():
            if value is None and key in ("mem_fraction_static", "max_running_requests"):
                continue  # left to SGLang's own default
            assert seen[key] == value, f"{label}: {key} parsed as {seen[key]!r}, meant {value!r}"
