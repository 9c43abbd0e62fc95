"""Each cross-field rule of `dsv4rl.checks.validate`, on copies of the two shipped recipes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from dsv4rl.checks import machine
from dsv4rl.checks import validate as validate_module
from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import CommBackend, QuantMode, RolloutEngineKind, TrainBackend
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.config.schema import Config, QuantConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.topology import data_parallel_size


@pytest.fixture(scope="module")
def tiny_base() -> Config:
    return compose("tiny_arith")


@pytest.fixture(scope="module")
def dapo_base() -> Config:
    return compose("dapo_math")


@pytest.fixture
def tiny(tiny_base: Config) -> Config:
    return copy.deepcopy(tiny_base)


@pytest.fixture
def dapo(dapo_base: Config) -> Config:
    return copy.deepcopy(dapo_base)


def problems(cfg: Config, check_paths: bool = False) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_paths=check_paths)
    return info.value.problems


def assert_problem(cfg: Config, *fragments: str, check_paths: bool = False) -> str:
    found = problems(cfg, check_paths)
    for problem in found:
        if all(f in problem for f in fragments):
            return problem
    raise AssertionError(f"no problem mentions {fragments}; got {found}")


# --- the shipped recipes ---------------------------------------------------------------------------


def test_tiny_arith_is_valid_with_path_checks(tiny: Config) -> None:
    validate(tiny, check_paths=True)


def test_dapo_math_is_valid_without_machine_checks(dapo: Config) -> None:
    validate(dapo, check_paths=False)
    assert data_parallel_size(dapo) == 4  # 16 training GPUs / (TP1 x PP4 x CP1)


def test_dapo_math_with_path_checks_names_model_path(dapo: Config) -> None:
    problem = assert_problem(dapo, "model.path", "/path/to/DeepSeek-V4-Flash", check_paths=True)
    assert "model.path=" in problem  # says how to fix it


def test_dapo_math_is_valid_once_the_machine_has_what_it_needs(dapo: Config, tmp_path: Path) -> None:
    # A native checkpoint in the release's format (FP8 linears, MXFP4 experts), at toy size, with the layers
    # SGLang serves (HCA at compress ratio 128, a 128-token window).
    model = tmp_path / "DeepSeek-V4-Flash"
    servable = ModelConfig(tiny=TinyModelConfig(hca_compress_rate=128, sliding_window=128))
    materialize_model(servable, str(model), QuantConfig(name=QuantMode.fp8_mxfp4))
    (tmp_path / "dapo.parquet").write_bytes(b"")
    (tmp_path / "aime24.jsonl").write_text("")
    dapo.model.path = dapo.model.tokenizer = str(model)
    dapo.data.path = str(tmp_path / "dapo.parquet")
    dapo.eval.dataset = str(tmp_path / "aime24.jsonl")
    dapo.cluster.master_addr = "10.0.0.1"
    dapo.cluster.node_addrs = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    validate(dapo, check_paths=True)  # the Megatron engine is built: nothing is left to refuse


def test_all_problems_are_reported_together(tiny: Config) -> None:
    tiny.train.steps = 0
    tiny.sync.bucket_bytes = 0
    with pytest.raises(ConfigError, match="has 2 problems") as info:
        validate(tiny)
    assert len(info.value.problems) == 2


# --- parallel layout -------------------------------------------------------------------------------


def test_world_must_divide_by_tp_pp_cp(dapo: Config) -> None:
    dapo.parallel.train.tensor_parallel = 3
    assert_problem(dapo, "training world size 16", "not divisible", "= 12")


def test_expert_parallel_must_divide_experts(dapo: Config) -> None:
    dapo.model.n_routed_experts = 250
    assert_problem(dapo, "expert_parallel=4", "250 routed experts", "model.n_routed_experts")


def test_expert_parallel_must_divide_tiny_experts(tiny: Config) -> None:
    tiny.parallel.train.backend = TrainBackend.megatron
    tiny.cluster.gpus_per_node = 8
    tiny.comm.backend = CommBackend.nccl
    tiny.parallel.train.nproc_per_node = 3
    tiny.parallel.train.expert_parallel = 3
    assert_problem(tiny, "expert_parallel=3", "model.tiny.n_routed_experts")


def test_expert_group_must_divide_stage(dapo: Config) -> None:
    dapo.parallel.train.expert_tensor_parallel = 2
    assert_problem(dapo, "expert_parallel x expert_tensor_parallel (4 x 2)", "pipeline stage")


def test_pipeline_cannot_exceed_layers(dapo: Config) -> None:
    dapo.model.num_hidden_layers = 3
    dapo.parallel.train.last_stage_layers = None
    assert_problem(dapo, "pipeline_parallel=4 exceeds", "3 layers")


def test_last_stage_layers_must_leave_even_split(dapo: Config) -> None:
    dapo.parallel.train.last_stage_layers = 12  # 31 layers do not split over 3 stages
    assert_problem(dapo, "last_stage_layers=12", "multiple of 3")


def test_uneven_pipeline_needs_last_stage_layers(dapo: Config) -> None:
    dapo.parallel.train.last_stage_layers = None  # 43 % 4 != 0
    assert_problem(dapo, "43 layers do not split evenly", "last_stage_layers")


def test_last_stage_layers_needs_pipeline(tiny: Config) -> None:
    tiny.parallel.train.last_stage_layers = 1
    assert_problem(tiny, "last_stage_layers=1 needs pipeline_parallel > 1")


def test_fsdp_rejects_model_parallel(tiny: Config) -> None:
    tiny.parallel.train.nproc_per_node = 2
    tiny.parallel.train.tensor_parallel = 2
    assert_problem(tiny, "fsdp backend", "tensor_parallel=2", "backend=megatron")


def test_megatron_runs_on_cpu(tiny: Config) -> None:
    tiny.parallel.train.backend = TrainBackend.megatron  # megatron-core through dsv4rl's CPU shims
    validate(tiny)


def test_more_training_processes_than_gpus(dapo: Config) -> None:
    dapo.parallel.train.nproc_per_node = 16
    assert_problem(dapo, "nproc_per_node=16 exceeds cluster.gpus_per_node=8")


def test_offload_fraction_in_range(dapo: Config) -> None:
    dapo.parallel.train.optimizer_offload_fraction = 1.5
    assert_problem(dapo, "optimizer_offload_fraction must be in [0, 1]")


def test_nonpositive_parallel_size(tiny: Config) -> None:
    tiny.parallel.train.pipeline_parallel = 0
    assert_problem(tiny, "parallel.train.pipeline_parallel must be >= 1")


# --- nodes, rollout, comm --------------------------------------------------------------------------


def test_disaggregated_nodes_must_add_up(dapo: Config) -> None:
    dapo.cluster.nnodes = 5
    assert_problem(dapo, "rollout.nnodes (2) + parallel.train.nnodes (2) must equal cluster.nnodes (5)")


def test_shared_nodes_must_match_cluster(tiny: Config) -> None:
    tiny.parallel.train.nnodes = 2
    assert_problem(tiny, "parallel.train.nnodes (2) must equal cluster.nnodes (1)")


def test_node_rank_in_range(tiny: Config) -> None:
    tiny.cluster.node_rank = 1
    assert_problem(tiny, "cluster.node_rank=1 must be in 0..0")


def test_sglang_rejected_on_cpu(tiny: Config) -> None:
    tiny.parallel.rollout.engine = RolloutEngineKind.sglang
    assert_problem(tiny, "engine=sglang needs GPUs", "engine=reference")


def test_engine_gpus_must_equal_rollout_tp(dapo: Config) -> None:
    dapo.parallel.rollout.gpus_per_engine = 4
    assert_problem(dapo, "gpus_per_engine=4 must equal", "tensor_parallel=8")


def test_rollout_gpus_must_fit(dapo: Config) -> None:
    dapo.parallel.rollout.num_engines = 5
    assert_problem(dapo, "5 engines x 8 GPUs = 40 GPUs", "have 16")


def test_rollout_expert_parallel_divides_tp(dapo: Config) -> None:
    dapo.parallel.rollout.expert_parallel = 3
    assert_problem(dapo, "rollout.expert_parallel=3 must divide")


def test_mem_fraction_in_range(dapo: Config) -> None:
    dapo.parallel.rollout.mem_fraction_static = 1.5
    assert_problem(dapo, "mem_fraction_static must be in (0, 1]")


def test_nccl_needs_gpus(tiny: Config) -> None:
    tiny.comm.backend = CommBackend.nccl
    assert_problem(tiny, "comm.backend=nccl needs GPUs", "comm=cpu_gloo")


def test_gloo_with_gpus_is_allowed(dapo: Config) -> None:
    dapo.comm.backend = CommBackend.gloo
    validate(dapo, check_paths=False)


# --- algorithm, sampling, optimizer ----------------------------------------------------------------


def test_group_size_at_least_two(tiny: Config) -> None:
    tiny.algo.group_size = 1
    assert_problem(tiny, "algo.group_size=1", ">= 2")


@pytest.mark.parametrize(
    ("field", "value"), [("eps_clip_low", 0.0), ("eps_clip_low", 1.0), ("eps_clip_high", 0.0)]
)
def test_eps_ranges(tiny: Config, field: str, value: float) -> None:
    setattr(tiny.algo, field, value)
    assert_problem(tiny, f"algo.{field}")


def test_batch_must_split_over_data_parallel(tiny: Config) -> None:
    tiny.parallel.train.nproc_per_node = 3  # 32 x 16 = 512 responses over 3 ranks
    assert_problem(tiny, "= 512 responses", "3 data-parallel ranks")


def test_batch_must_split_into_minibatches(tiny: Config) -> None:
    tiny.algo.updates_per_step = 3
    assert_problem(tiny, "updates_per_step=3")


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("top_k", 0, "top_k must be -1 (off) or >= 1"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
    ],
)
def test_sampling_params(tiny: Config, field: str, value: float, fragment: str) -> None:
    setattr(tiny.algo.sampling, field, value)
    assert_problem(tiny, "algo.sampling." + fragment)


def test_greedy_and_top_k_are_valid(tiny: Config) -> None:
    tiny.algo.sampling.temperature = 0.0
    tiny.algo.sampling.top_k = 1
    validate(tiny)


def test_eval_sampling_checked_when_eval_on(dapo: Config) -> None:
    dapo.eval.sampling.top_p = 0.0
    assert_problem(dapo, "eval.sampling.top_p")


def test_eval_k_within_samples(dapo: Config) -> None:
    dapo.eval.k = [1, 16]
    assert_problem(dapo, "eval.k values must be in 1..samples_per_problem=8")


def test_overlong_that_never_fires(tiny: Config) -> None:
    tiny.algo.overlong.enabled = True  # expected_len 16384 vs max_new_tokens 4
    assert_problem(tiny, "algo.overlong.expected_len=16384", "can never apply")


def test_async_rollout_needs_a_staleness_correction_and_its_own_devices(tiny: Config) -> None:
    tiny.algo.async_rollout = True
    validate(tiny, check_paths=False)  # TIS unset: on for an off-policy run
    tiny.algo.tis.enabled = False
    assert_problem(tiny, "algo.async_rollout=true", "algo.tis.enabled=false", "algo.tis.enabled=true")
    tiny.algo.mis.enabled = True
    validate(tiny, check_paths=False)
    tiny.parallel.colocate = True
    assert_problem(tiny, "parallel.colocate=true")


def test_max_staleness_is_a_bound_of_0_or_more(tiny: Config) -> None:
    tiny.algo.max_staleness = 1  # the same as async_rollout=true: a correction and devices of its own
    tiny.algo.tis.enabled = False
    assert_problem(
        tiny, "algo.max_staleness=1 trains on samples up to 1 weight version(s) old", "algo.tis.enabled=true"
    )
    tiny.algo.tis.enabled = True
    validate(tiny, check_paths=False)
    tiny.algo.max_staleness = 4  # fully asynchronous
    validate(tiny, check_paths=False)
    tiny.parallel.colocate = True
    assert_problem(tiny, "algo.max_staleness=4 needs the engines generating while the trainer trains")
    tiny.parallel.colocate = False
    tiny.algo.max_staleness = -1
    assert_problem(tiny, "algo.max_staleness must be >= 0")
    tiny.algo.max_staleness, tiny.algo.async_rollout = 0, True
    assert_problem(tiny, "algo.max_staleness=0 allows none")
    tiny.algo.max_staleness = None
    validate(tiny, check_paths=False)


def test_tis_clip_positive(tiny: Config) -> None:
    tiny.algo.tis.clip = 0.0
    assert_problem(tiny, "algo.tis.clip must be > 0")


def test_optimizer_rules(tiny: Config) -> None:
    tiny.optim.name = "sgd"
    tiny.optim.lr = 0.0
    tiny.optim.betas = [0.9]
    found = " | ".join(problems(tiny))
    assert "optim.name='sgd'" in found and "choose one of adamw" in found
    assert "optim.lr must be > 0" in found
    assert "optim.betas must be two values" in found


# --- model -----------------------------------------------------------------------------------------


def test_tiny_layer_types_length(tiny: Config) -> None:
    tiny.model.tiny.num_hidden_layers = 4
    assert_problem(tiny, "model.tiny.layer_types lists 3 entries but num_hidden_layers=4")
    assert_problem(tiny, "model.tiny.mlp_layer_types lists 3 entries")


def test_tiny_layer_type_values(tiny: Config) -> None:
    tiny.model.tiny.layer_types = ["sliding_attention", "full_attention", "heavily_compressed_attention"]
    tiny.model.tiny.mlp_layer_types = ["hash_moe", "dense", "moe"]
    assert_problem(tiny, "layer_types has unknown values ['full_attention']")
    assert_problem(tiny, "mlp_layer_types has unknown values ['dense']", "hash_moe, moe")


def test_index_topk_covers_longest_sequence(tiny: Config) -> None:
    tiny.data.max_prompt_len = 100  # ceil((100 + 4) / 4) = 26 > 16
    problem = assert_problem(tiny, "model.tiny.index_topk=16", "= 26", "cached decoding")
    assert "model.tiny.index_topk=26" in problem


def test_layer_type_constants_match_the_model_module() -> None:
    from dsv4rl.model import tiny

    constants = {"LAYER_TYPES": tiny.LAYER_TYPES, "MLP_TYPES": tiny.MLP_TYPES}
    assert constants == {"LAYER_TYPES": validate_module.LAYER_TYPES, "MLP_TYPES": validate_module.MLP_TYPES}


# --- paths -----------------------------------------------------------------------------------------


def test_model_path_must_exist(tiny: Config, tmp_path: Path) -> None:
    tiny.model.path = str(tmp_path / "missing")
    problem = assert_problem(tiny, "model.path", "missing", "does not exist", check_paths=True)
    assert "model.path=<that directory>" in problem
    validate(tiny, check_paths=False)  # skipped without path checks


def test_model_path_needs_config_json(tiny: Config, tmp_path: Path) -> None:
    tiny.model.path = str(tmp_path)
    assert_problem(tiny, "has no config.json", check_paths=True)


def test_data_path_must_exist(tiny: Config, tmp_path: Path) -> None:
    tiny.data.path = str(tmp_path / "nope.jsonl")
    assert_problem(tiny, "data.path", "nope.jsonl", "does not exist", check_paths=True)


def test_data_file_needs_path(tiny: Config) -> None:
    tiny.data.name = "dapo_math"
    assert_problem(tiny, "data.name='dapo_math' reads a file")


def test_multinode_needs_real_master_addr(dapo: Config) -> None:
    assert_problem(dapo, "cluster.master_addr=127.0.0.1", "cluster.nnodes=4", check_paths=True)


def test_multinode_needs_node_addrs(dapo: Config) -> None:
    problem = assert_problem(dapo, "cluster.node_addrs is empty", "nodes 2..3", check_paths=True)
    assert "cluster.node_addrs=[host0" in problem and "dapo_math_4node.sbatch" in problem  # the fix
    dapo.cluster.node_addrs = ["n0", "n1", "n2", "n3"]
    assert not any("node_addrs" in p for p in problems(dapo, check_paths=True))


def test_node_addrs_must_list_every_node(dapo: Config) -> None:
    dapo.cluster.node_addrs = ["n0", "n1", "n2"]
    assert_problem(dapo, "cluster.node_addrs lists 3 address(es) but cluster.nnodes=4", "node-rank order")
    dapo.cluster.node_addrs = ["n0", "n1", "", "n3"]
    assert_problem(dapo, "cluster.node_addrs has an empty entry")


def test_node_addrs_must_not_be_loopback(dapo: Config) -> None:
    dapo.cluster.node_addrs = ["n0", "n1", "127.0.0.1", "n3"]
    assert_problem(dapo, "loopback address(es) ['127.0.0.1']", check_paths=True)


def test_remote_engines_must_not_bind_loopback(dapo: Config) -> None:
    assert dapo.engine.host == "0.0.0.0"  # the recipe: engines reached from node 0
    dapo.engine.host = "127.0.0.1"
    assert_problem(dapo, "engine.host=127.0.0.1 binds loopback only", "set engine.host=0.0.0.0")


def test_every_node_on_loopback_is_one_machine(tiny: Config) -> None:
    """Two nodes with loopback addresses run on this machine: loopback engines and master are fine."""
    tiny.cluster.nnodes, tiny.cluster.node_addrs = 2, ["127.0.0.1", "127.0.0.1"]
    tiny.parallel.rollout.nnodes = 1
    assert tiny.engine.host == "127.0.0.1" and tiny.cluster.master_addr == "127.0.0.1"
    validate(tiny, check_paths=True)
    tiny.cluster.node_timeout_s = 0
    assert_problem(tiny, "cluster.node_timeout_s must be > 0")


# --- ports, train, sync, reward --------------------------------------------------------------------


@pytest.mark.parametrize("port", [0, 70000])
def test_ports_in_range(tiny: Config, port: int) -> None:
    tiny.cluster.master_port = port
    assert_problem(tiny, "ports must be in 1..65535", f"cluster.master_port={port}")


def test_ports_do_not_collide(tiny: Config) -> None:
    tiny.cluster.weight_sync_port = tiny.engine.port
    assert_problem(tiny, "cluster.weight_sync_port=30000 collides with the engine ports")
    tiny.cluster.weight_sync_port = tiny.cluster.master_port
    assert_problem(tiny, "cluster.master_port=29500 is one of the weight-sync ports")


def test_each_pipeline_stage_needs_its_own_weight_sync_port(dapo: Config) -> None:
    """PP4: the groups listen on weight_sync_port + 0..3, which must stay clear of the other ports."""
    dapo.cluster.master_port = dapo.cluster.weight_sync_port + 3
    assert_problem(
        dapo, "cluster.master_port=29603 is one of the weight-sync ports", "(+ 0..3, one per pipeline"
    )
    dapo.cluster.master_port = 29500
    dapo.cluster.weight_sync_port = dapo.engine.port - 2
    assert_problem(dapo, "cluster.weight_sync_port=29998 (+ 0..3, one per pipeline stage) collides with")
    dapo.cluster.weight_sync_port = 65534
    assert_problem(dapo, "the weight-sync ports run past 65535")


@pytest.mark.parametrize(
    ("section", "field", "value", "fragment"),
    [
        ("train", "steps", 0, "train.steps must be >= 1"),
        ("train", "checkpoint_every", -1, "train.checkpoint_every must be >= 0"),
        ("run", "step_timeout_s", -1.0, "run.step_timeout_s must be >= 0 (got -1.0; 0 turns the hang"),
        ("sync", "bucket_bytes", 0, "sync.bucket_bytes must be > 0"),
        ("sync", "timeout_s", 0.0, "sync.timeout_s must be > 0"),
        (
            "sync",
            "pause_mode",
            "stop",
            "sync.pause_mode='stop' is unknown; choose one of abort, retract, in_place",
        ),
        (
            "reward",
            "grader",
            "regex",
            "reward.grader='regex' is unknown; choose one of arith, dapo, answer_line, boxed",
        ),
        ("eval", "grader", "regex", "eval.grader='regex' is unknown"),
    ],
)
def test_scalar_rules(tiny: Config, section: str, field: str, value: object, fragment: str) -> None:
    setattr(getattr(tiny, section), field, value)
    assert_problem(tiny, fragment)


def test_checkpoint_every_zero_is_allowed(tiny: Config) -> None:
    tiny.train.checkpoint_every = 0
    validate(tiny)


def test_unbuilt_features_are_refused_before_a_run_but_still_plan() -> None:
    from dsv4rl.checks.validate import validate
    from dsv4rl.config.compose import compose

    cfg = compose("dapo_math", ["model.path=/nonexistent"])
    validate(cfg, check_paths=False)  # composes and plans anywhere
    with pytest.raises(ConfigError) as error:
        validate(cfg, check_paths=True)
    message = str(error.value)
    assert "/nonexistent" in message and "megatron" not in message  # the Megatron engine is built
    assert "quant=" not in message  # FP8 weights on the wire are built


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("lr_schedule", "linear", "choose one of constant, cosine"), ("min_lr_ratio", 1.5, "min_lr_ratio")],
)
def test_lr_schedule_settings(tiny: Config, key: str, value: object, message: str) -> None:
    setattr(tiny.optim, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(tiny, check_paths=False)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("context_parallel", 2, "no context parallelism"),
        ("expert_tensor_parallel", 2, "keeps each expert whole"),
        ("tensor_parallel", 3, "must divide the attention heads (4) and the output groups (2)"),
    ],
)
def test_megatron_layouts_it_cannot_run_are_refused(tiny: Config, key: str, value: int, message: str) -> None:
    tiny.parallel.train.backend = TrainBackend.megatron
    tiny.parallel.train.nproc_per_node = 6
    setattr(tiny.parallel.train, key, value)
    assert_problem(tiny, message)


def test_megatron_heads_are_checked_against_the_checkpoint(dapo: Config, tmp_path: Path) -> None:
    """A model directory's own head and output-group counts bound tensor_parallel too."""
    model = tmp_path / "model"
    materialize_model(ModelConfig(), str(model))  # the tiny model: 4 heads, 2 output groups
    dapo.model.path = str(model)
    dapo.parallel.train.tensor_parallel = 4
    problems: list[str] = []
    machine.check_model_layout(dapo, problems.append)
    assert any("must divide the attention heads (4) and the output groups (2)" in p for p in problems), (
        problems
    )


# --- eval sets ---------------------------------------------------------------------------------------


def test_eval_rules_name_the_fix(tiny: Config, dapo: Config) -> None:
    tiny.eval.name = "aime25"
    assert_problem(tiny, "eval.name='aime25' is not an eval set", "aime24")
    tiny.eval.name, tiny.eval.dataset = "aime24", None
    assert_problem(tiny, "eval.name='aime24' needs its data: data.path=<file>")
    tiny.eval.name, tiny.eval.prompt_template = "tiny_arith", "no placeholder"
    assert_problem(tiny, "eval.prompt_template='no placeholder' is neither a named template (dapo)")
    tiny.eval.prompt_template, tiny.eval.max_problems = None, 0
    assert_problem(tiny, "eval.max_problems must be >= 1")
    dapo.eval.name, dapo.eval.dataset, dapo.eval.holdout = "dapo_math_holdout", dapo.data.path, 600
    assert_problem(dapo, "eval.holdout=600 scores the last 600 rows", "set data.holdout=600")


def test_slurm_settings_need_a_slurm_cluster(tiny: Config) -> None:
    tiny.cluster.partition = "gpu"
    assert_problem(tiny, "cluster.partition is a Slurm setting", "cluster.kind=local")


def test_the_reference_engines_emulation_flag_is_refused_with_sglang(dapo: Config, tiny: Config) -> None:
    dapo.engine.extra_args = ["--emulate-non-idempotent-postprocess"]
    assert_problem(dapo, "engine.extra_args has --emulate-non-idempotent-postprocess", "SGLang has none")
    tiny.engine.extra_args = ["--emulate-non-idempotent-postprocess"]
    validate(tiny, check_paths=False)


def test_max_requeues_is_not_negative(tiny: Config) -> None:
    tiny.cluster.max_requeues = -1
    assert_problem(tiny, "cluster.max_requeues must be >= 0")


def test_engine_restart_bounds_are_checked(tiny: Config) -> None:
    tiny.engine.max_restarts = -1
    assert_problem(tiny, "engine.max_restarts must be >= 0 (got -1; 0: an engine failure stops the run)")
    tiny.parallel.rollout.num_engines = 2
    tiny.engine.min_alive = 3
    assert_problem(tiny, "engine.min_alive=3 must be between 1 and the run's 2 engine(s)")
    tiny.engine.min_alive = 0
    assert_problem(tiny, "engine.min_alive=0 must be between 1")
    tiny.engine.health_timeout_s = 0
    assert_problem(tiny, "engine.health_timeout_s must be > 0")


def test_oversampling_is_the_streams_and_its_filter_is_checked(tiny: Config, tmp_path: Path) -> None:
    tiny.algo.oversample.factor = 2.0
    assert_problem(tiny, "algo.oversample (factor 2, filter none)", "set algo.max_staleness=2 or more")
    tiny.algo.max_staleness = 2
    validate(tiny, check_paths=False)
    tiny.algo.oversample.factor = 0.5
    assert_problem(tiny, "algo.oversample.factor must be >= 1 (got 0.5)")
    tiny.algo.oversample.factor, tiny.algo.oversample.timeout_s = 1.0, 0.0
    assert_problem(tiny, "algo.oversample.timeout_s must be > 0")
    tiny.algo.oversample.timeout_s = 30.0
    tiny.algo.oversample.filter = "builtin:nonzero_sd"
    assert_problem(tiny, "no builtin filter 'nonzero_sd'", "did you mean builtin:nonzero_std?")
    tiny.algo.oversample.filter = "builtin:nonzero_std"
    validate(tiny, check_paths=False)
    filters = tmp_path / "filters.py"
    filters.write_text("async def a(group, rewards):\n    return True\n\n\ndef b(group):\n    return True\n")
    tiny.algo.oversample.filter = f"{filters}:a"
    assert_problem(tiny, "a is async", "plain `def`", check_paths=True)
    tiny.algo.oversample.filter = f"{filters}:b"
    assert_problem(tiny, "cannot be called as b(group, rewards=...)", check_paths=True)
    tiny.algo.oversample.filter = f"{filters}:c"
    assert_problem(tiny, "has no function 'c'", check_paths=True)
