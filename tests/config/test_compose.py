"""Recipe composition: Hydra groups + overrides -> typed Config, and the error messages for mistakes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dsv4rl.config.choices import CommBackend, EvalSet, QuantMode, RolloutEngineKind, TrainBackend
from dsv4rl.config.compose import (
    RECIPES_ENV,
    ConfigError,
    compose,
    describe_type,
    find_recipes_dir,
    list_groups,
    list_recipes,
    load_config_file,
    schema_type,
    to_dictconfig,
    to_yaml,
)
from dsv4rl.config.schema import Config, TrainParallelConfig

REPO_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_recipes_dir_is_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECIPES_ENV, raising=False)
    assert find_recipes_dir() == REPO_RECIPES
    assert {"tiny_arith", "dapo_math"} <= set(list_recipes())
    groups = list_groups()
    assert set(groups) == {"model", "parallel", "comm", "quant", "algo", "data", "eval", "cluster"}
    assert groups["parallel"] == ["cpu_fsdp2", "cpu_single", "flash_4node_disagg"]


def test_tiny_arith_composes() -> None:
    cfg = compose("tiny_arith")
    assert isinstance(cfg, Config)
    assert cfg.recipe == "tiny_arith"
    assert cfg.model.path is None and cfg.model.name == "tiny_dsv4"
    assert cfg.parallel.train.backend is TrainBackend.fsdp
    assert cfg.parallel.rollout.engine is RolloutEngineKind.reference
    assert cfg.comm.backend is CommBackend.gloo
    assert cfg.reward.grader == "arith"
    assert cfg.run.dir == "runs/tiny_arith"
    assert (cfg.algo.prompts_per_step, cfg.algo.group_size) == (32, 16)
    assert cfg.eval is not None and cfg.eval.name is EvalSet.tiny_arith and cfg.eval.every_steps == 20


def test_no_eval_set_is_null_not_a_name() -> None:
    """`eval=none` leaves no eval section (no sentinel name); a written config reads back the same."""
    for recipe in ("tiny_arith", "dapo_math"):
        cfg = compose(recipe, ["eval=none"])
        assert cfg.eval is None
        assert "eval: null" in to_yaml(cfg)
    with pytest.raises(ConfigError, match="eval.name: expected one of"):
        compose("tiny_arith", ["eval.name=aime25"])


def test_dapo_math_composes_with_reference_run_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSV4RL_DATA_DIR", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    cfg = compose("dapo_math")
    m, t, r = cfg.model, cfg.parallel.train, cfg.parallel.rollout
    assert (m.total_params_b, m.num_hidden_layers, m.n_routed_experts) == (284.0, 43, 256)
    assert m.tokenizer == "deepseek_v4"  # the packaged tokenizer; model.path's own wins when it has one
    assert t.backend is TrainBackend.megatron
    assert (t.tensor_parallel, t.pipeline_parallel, t.expert_parallel, t.expert_tensor_parallel) == (
        1,
        4,
        4,
        1,
    )
    assert (t.last_stage_layers, t.optimizer_offload_fraction, t.precision_aware_optimizer) == (
        10,
        1.0,
        True,
    )
    assert (t.nnodes, t.nproc_per_node, r.nnodes, r.num_engines, r.gpus_per_engine) == (2, 8, 2, 2, 8)
    assert (r.mem_fraction_static, r.max_running_requests, r.watchdog_timeout_s) == (0.7, 48, 1800.0)
    assert r.engine is RolloutEngineKind.sglang
    assert cfg.comm.backend is CommBackend.nccl
    env = cfg.comm.env
    assert env["NCCL_MIN_NCHANNELS"] == "16" and env["NCCL_P2P_NET_CHUNKSIZE"] == "262144"
    assert "SGLANG_DSV4_FP4_EXPERTS" not in env and env["HSA_NO_SCRATCH_RECLAIM"] == "1"
    assert cfg.quant.name is QuantMode.fp8_rollout and cfg.quant.block_size == [128, 128]
    assert cfg.quant.engine_env == {"SGLANG_DSV4_FP4_DEQUANT": "1", "SGLANG_OPT_FP8_WO_A_GEMM": "0"}
    a = cfg.algo
    assert (a.eps_clip_low, a.eps_clip_high, a.kl_coef) == (0.2, 0.28, 0.0)
    assert a.tis.enabled and a.tis.clip == 2.0 and not a.dynamic_sampling.enabled and not a.overlong.enabled
    assert a.name == "grpo" and a.loss_aggregation == "seq_mean_token_mean" and a.async_rollout
    assert (a.prompts_per_step, a.group_size, a.sampling.max_new_tokens, a.sampling.temperature) == (
        32,
        8,
        4096,
        0.8,
    )
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas) == (1e-6, 0.1, [0.9, 0.98])
    assert cfg.sync.bucket_bytes == 256 << 20
    assert (
        cfg.data.path == "data/dapo_math_17k.parquet" and cfg.reward.grader == "boxed"
    )  # no DSV4RL_DATA_DIR
    assert (cfg.reward.correct, cfg.reward.incorrect, cfg.data.reasoning_effort) == (1.0, 0.0, "low")
    assert (cfg.eval.samples_per_problem, cfg.eval.k, cfg.eval.sampling.top_p) == (8, [1, 2, 4, 8], 0.7)
    assert cfg.eval.grader == "boxed" and cfg.eval.prompt_template is None
    assert (cfg.cluster.nnodes, cfg.cluster.gpus_per_node, cfg.cluster.node_rank) == (4, 8, 0)
    assert cfg.cluster.node_addrs == [] and cfg.engine.host == "0.0.0.0"  # addresses come from the launcher


def test_node_addrs_override_keeps_strings() -> None:
    """What launch/slurm/dapo_math_4node.sbatch passes: quoted hostnames stay strings, IPs too."""
    cfg = compose("dapo_math", ["cluster.node_addrs=['gpu-a01','10.0.0.2','1e5','007']"])
    assert cfg.cluster.node_addrs == ["gpu-a01", "10.0.0.2", "1e5", "007"]
    assert compose("tiny_arith").cluster.node_addrs == []


def test_environment_fills_cluster_and_data_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4RL_DATA_DIR", "/data")
    monkeypatch.setenv("MASTER_ADDR", "node-0")
    monkeypatch.setenv("SLURM_NODEID", "3")
    cfg = compose("dapo_math")
    assert cfg.data.path == "/data/dapo_math_17k.parquet" and cfg.eval.dataset == "/data/aime24.jsonl"
    assert (cfg.cluster.master_addr, cfg.cluster.node_rank) == ("node-0", 3)


def test_overrides_values_groups_and_additions() -> None:
    cfg = compose(
        "tiny_arith",
        [
            "run.dir=runs/demo",
            "resume=true",
            "algo.group_size=4",
            "parallel=cpu_fsdp2",
            "algo=dapo",
            "+comm.env.OMP_NUM_THREADS=1",
            "eval.k=[1,2]",
        ],
    )
    assert (cfg.run.dir, cfg.resume, cfg.algo.group_size) == ("runs/demo", "true", 4)
    assert cfg.parallel.train.nproc_per_node == 2
    assert cfg.algo.name == "dapo" and cfg.algo.eps_clip_high == 0.28
    assert cfg.algo.sampling.max_new_tokens == 1  # the recipe's own values win over the group's
    assert cfg.comm.env == {"OMP_NUM_THREADS": "1"}
    assert cfg.eval.k == [1, 2]


def test_model_path_override_keeps_the_packaged_tokenizer_choice() -> None:
    """The checkpoint's tokenizer is used at run time (dsv4rl.model.tokenizer.run_tokenizer); the packaged one
    is what `dsv4rl prompts` and the checks use without a checkpoint."""
    cfg = compose("dapo_math", ["model.path=/models/flash"])
    assert (cfg.model.path, cfg.model.tokenizer) == ("/models/flash", "deepseek_v4")


@pytest.mark.parametrize("override", ["algo.grup_size=4", "+algo.grup_size=4"])
def test_unknown_key_lists_valid_keys(override: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose("tiny_arith", [override])
    message = str(info.value)
    assert "'algo.grup_size'" in message and "did you mean 'algo.group_size'" in message
    assert "valid keys under algo:" in message and "prompts_per_step" in message and "sampling" in message


def test_unknown_top_level_key() -> None:
    with pytest.raises(ConfigError, match="unknown key 'foo'; valid keys at the top level: recipe, seed"):
        compose("tiny_arith", ["foo=1"])


def test_new_dict_entry_needs_plus() -> None:
    with pytest.raises(ConfigError, match=r"add a new entry with \+comm.env.X=<value>"):
        compose("tiny_arith", ["comm.env.X=1"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algo.group_size=abc", "algo.group_size: expected int, got 'abc'"),
        ("parallel.train.backend=tpu", "parallel.train.backend: expected one of fsdp, megatron, got 'tpu'"),
        ("algo.sampling.top_k=null", "algo.sampling.top_k cannot be null; expected int"),
        ("optim.betas=0.9", "optim.betas: expected a list of float"),
    ],
)
def test_wrong_type_names_expected_type(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose("tiny_arith", [override])
    assert expected in str(info.value)


def test_unknown_recipe_lists_recipes() -> None:
    with pytest.raises(
        ConfigError,
        match="unknown recipe 'nope'; available recipes: dapo_math, dapo_math_h200, dapo_math_tir, "
        "dapo_math_v41, dapo_math_v41_h200, tiny_arith, tiny_tool",
    ):
        compose("nope")


def test_unknown_group_option_lists_options() -> None:
    with pytest.raises(ConfigError) as info:
        compose("tiny_arith", ["parallel=foo"])
    assert "unknown option 'foo' for config group 'parallel'" in str(info.value)
    assert "cpu_fsdp2, cpu_single, flash_4node_disagg" in str(info.value)


def test_a_key_under_a_section_the_recipe_leaves_null_names_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        compose(
            "tiny_tool", ["quant.block_size=[64,64]", "eval.every_steps=0"]
        )  # eval: none (quant's sets no null)
    message = str(info.value)
    assert "eval.every_steps sets a key of `eval`, which this recipe leaves null (eval: none)" in message
    assert "eval=<option>; options: aime24" in message and "none," not in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algo.group_size=[1", "cannot parse override"),
        ("algo.group_size=1,2", "is a sweep"),
        ("recipe=dapo_math", "the recipe is chosen once"),
    ],
)
def test_malformed_overrides(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        compose("tiny_arith", [override])


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_yaml_and_dictconfig_round_trip() -> None:
    cfg = compose("tiny_arith", ["algo.group_size=4"])
    text = to_yaml(cfg)
    assert "group_size: 4" in text and "backend: fsdp" in text
    back = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text)))
    assert back == cfg
    assert to_dictconfig(cfg).parallel.train.backend is TrainBackend.fsdp


def test_schema_type_descriptions() -> None:
    assert schema_type("parallel.train") is TrainParallelConfig
    assert describe_type(schema_type("model.path")) == "str or null"
    assert describe_type(schema_type("comm.env")) == "a mapping of str to str"
    assert schema_type("algo.nope") is None


# --- recipes found elsewhere -----------------------------------------------------------------------


def _copy_recipes(target: Path) -> Path:
    shutil.copytree(REPO_RECIPES, target)
    return target


def test_env_var_points_at_other_recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = _copy_recipes(tmp_path / "mine")
    (other / "my_run.yaml").write_text(
        (other / "tiny_arith.yaml").read_text().replace("runs/tiny_arith", "runs/mine")
    )
    monkeypatch.setenv(RECIPES_ENV, str(other))
    assert find_recipes_dir() == other.resolve()
    assert "my_run" in list_recipes()
    assert compose("my_run").run.dir == "runs/mine"


def test_env_var_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{RECIPES_ENV}="):
        find_recipes_dir(environ={RECIPES_ENV: str(tmp_path / "missing")})


def test_packaged_recipes_when_not_a_checkout(tmp_path: Path) -> None:
    # site-packages/dsv4rl/recipes, as the wheel force-includes it; no pyproject.toml two levels up
    package = tmp_path / "site-packages" / "dsv4rl"
    (package / "recipes").mkdir(parents=True)
    assert find_recipes_dir(package_dir=package, environ={}) == (package / "recipes").resolve()


def test_checkout_recipes_preferred(tmp_path: Path) -> None:
    package = tmp_path / "repo" / "src" / "dsv4rl"
    (package / "recipes").mkdir(parents=True)
    (tmp_path / "repo" / "recipes").mkdir()
    (tmp_path / "repo" / "pyproject.toml").write_text("")
    assert find_recipes_dir(package_dir=package, environ={}) == (tmp_path / "repo" / "recipes").resolve()


def test_no_recipes_anywhere(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=RECIPES_ENV):
        find_recipes_dir(package_dir=tmp_path / "dsv4rl", environ={})


def test_recipe_file_errors_name_the_file(tmp_path: Path) -> None:
    other = _copy_recipes(tmp_path / "r")
    grpo = other / "algo" / "grpo.yaml"
    grpo.write_text(grpo.read_text().replace("kl_coef:", "kl_coeff:"))
    with pytest.raises(ConfigError) as info:
        compose("tiny_arith", recipes_dir=other)
    assert "unknown key 'algo.kl_coeff'" in str(info.value) and "algo/grpo.yaml" in str(info.value)


def test_recipe_must_list_the_schema(tmp_path: Path) -> None:
    other = _copy_recipes(tmp_path / "r")
    recipe = other / "tiny_arith.yaml"
    recipe.write_text(recipe.read_text().replace("  - dsv4rl_schema", ""))
    with pytest.raises(ConfigError, match="must list `- dsv4rl_schema`"):
        compose("tiny_arith", recipes_dir=other)


def test_load_config_file_round_trips(tmp_path: Path) -> None:
    cfg = compose("tiny_arith", ["algo.group_size=4"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config_file(path) == cfg


def test_load_config_file_rejects_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("algo:\n  grup_size: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'algo.grup_size'.*config.yaml"):
        load_config_file(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "missing.yaml")


def test_a_recipe_file_extends_a_recipe_and_names_its_own_directory(tmp_path) -> None:
    """`recipe=path/to/recipe.yaml`: the groups and base recipes come from the recipes directory,
    `${recipe_dir:}` is the file's own directory (examples name their data and reward files with it)."""
    from dsv4rl.config.compose import recipe_dir, reward_base_dirs

    recipe = tmp_path / "task.yaml"
    recipe.write_text(
        "# my task\ndefaults:\n  - dsv4rl_schema\n  - tiny_arith\n  - _self_\n"
        "data:\n  path: ${recipe_dir:}/rows.jsonl\n  name: rows\n"
        "reward:\n  fns:\n    - {name: ok, target: 'reward.py:score', kwargs: {nested: {a: [1, 2]}}}\n"
    )
    cfg = compose(str(recipe), ["algo.group_size=4"])
    assert cfg.recipe == str(recipe) and cfg.data.path == str(tmp_path / "rows.jsonl")
    assert cfg.algo.group_size == 4 and cfg.algo.prompts_per_step == 32  # from tiny_arith
    assert cfg.reward.fns[0].kwargs == {"nested": {"a": [1, 2]}}
    assert recipe_dir(cfg) == tmp_path and reward_base_dirs(cfg)[0] == tmp_path
    with pytest.raises(ConfigError, match="recipe file 'nope/task.yaml' does not exist"):
        compose("nope/task.yaml")


def test_a_list_entrys_bad_key_is_named_with_its_list() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'reward.fns\[\].targt'; did you mean 'target'\?"):
        compose("tiny_arith", ["reward.fns=[{name: ok, targt: x}]"])
    with pytest.raises(
        ConfigError, match=r"reward.fns\[\].on_error: expected one of fail, zero, exclude, got 'skip'"
    ):
        compose("tiny_arith", ["reward.fns=[{name: ok, on_error: skip}]"])
