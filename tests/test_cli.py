"""The `dsv4rl` CLI: argument handling, --cfg, error display and the hand-off to the supervisor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dsv4rl.launcher.run
from dataset_files import DATA, needs_data
from dsv4rl.cli import app
from dsv4rl.config.schema import Config
from dsv4rl.launcher.plan_view import restarts_text

runner = CliRunner()


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """A fake `run_training` that records the configs it was asked to run."""
    calls: list[Config] = []

    def run_training(cfg: Config) -> int:
        calls.append(cfg)
        return 0 if cfg.train.steps != 7 else 3

    monkeypatch.setattr(dsv4rl.launcher.run, "run_training", run_training)
    return calls


def test_train_composes_validates_and_runs(supervisor: list[Config]) -> None:
    result = runner.invoke(
        app, ["train", "recipe=tiny_arith", "run.dir=runs/demo", "algo.group_size=4", "resume=true"]
    )
    assert result.exit_code == 0, result.output
    (cfg,) = supervisor
    assert (cfg.recipe, cfg.run.dir, cfg.algo.group_size) == ("tiny_arith", "runs/demo", 4)
    assert cfg.resume == "true"  # ResumeMode.true


def test_train_exits_with_the_supervisor_code(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=tiny_arith", "train.steps=7"])
    assert result.exit_code == 3


@pytest.mark.parametrize("flag", ["--cfg", "--print-config"])
def test_cfg_prints_yaml_and_starts_nothing(supervisor: list[Config], flag: str) -> None:
    result = runner.invoke(app, ["train", "recipe=tiny_arith", flag, "algo.group_size=4"])
    assert result.exit_code == 0, result.output
    assert "recipe: tiny_arith" in result.output and "group_size: 4" in result.output
    assert supervisor == []


def test_cfg_skips_path_checks_for_cluster_recipe(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=dapo_math", "--cfg"])
    assert result.exit_code == 0, result.output
    assert "path: /path/to/DeepSeek-V4-Flash" in result.output and "backend: megatron" in result.output
    assert supervisor == []


def test_train_runs_path_checks(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=dapo_math"])
    assert result.exit_code == 2
    assert "model.path" in result.output and "Traceback" not in result.output
    assert supervisor == []


def test_missing_recipe_lists_recipes(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "run.dir=x"])
    assert result.exit_code == 2
    assert (
        "no recipe given" in result.output
        and "dapo_math_tir, dapo_math_v41, dapo_math_v41_h200, tiny_arith" in result.output
    )


def test_config_errors_exit_2_without_traceback(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=tiny_arith", "algo.grup_size=4"])
    assert result.exit_code == 2
    assert "error: unknown key 'algo.grup_size'" in result.output
    assert "valid keys under algo" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_validation_errors_exit_2(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=tiny_arith", "algo.group_size=1"])
    assert result.exit_code == 2 and "algo.group_size=1" in result.output
    assert supervisor == []


def test_recipes_command_lists_recipes_and_groups() -> None:
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    for name in ("tiny_arith", "dapo_math", "parallel", "flash_4node_disagg", "rccl_mi355x", "aime24"):
        assert name in result.output


# --- dsv4rl plan ------------------------------------------------------------------------------------

DAPO_ADDRS = ["cluster.node_addrs=['gpu-a01','gpu-a02','gpu-a03','gpu-a04']", "cluster.master_addr=gpu-a01"]


def plan_json(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_plan_says_whether_a_failed_engine_is_restarted() -> None:
    two = ["recipe=tiny_arith", "parallel.rollout.num_engines=2"]
    assert plan_json(*two)["engine"]["max_restarts"] == 3
    cases = {
        (*two,): "a dead or hung engine is restarted, at most 3 times, while the others generate",
        ("recipe=tiny_arith",): "engine restarts: none with one engine (engine.min_alive=1)",
        (*two, "engine.max_restarts=0"): "engine restarts: off; an engine failure stops the run",
        (*two, "parallel.colocate=true"): "engine restarts: off (colocated engines share the trainer's GPUs)",
    }
    for args, line in cases.items():
        result = runner.invoke(app, ["plan", *args])
        assert result.exit_code == 0 and line in " ".join(result.output.split()), result.output
    assert "a hung one is found by its heartbeats" in runner.invoke(app, ["plan", *two]).output
    emulate = "engine.extra_args=[--emulate-non-idempotent-postprocess]"
    for args, restarted in (((*two, emulate), True), ((*two, emulate, "engine.max_restarts=0"), False)):
        text = " ".join(runner.invoke(app, ["plan", *args]).output.split())
        assert "a failed weight push spends the engines" in text and "exit 76" in text
        assert ("the trainer asks for them to be restarted and pushes again" in text) is restarted
    sglang = {**plan_json(*two)["engine"], "hang_detection": "health_generate"}  # as an SGLang plan says
    assert restarts_text(sglang).endswith(
        "hung: two /health_generate probes in a row unanswered within engine.health_timeout_s=10 s while "
        "requests are open"
    )


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def fake_interpreter(tmp_path: Path, torch: str, sglang: str | None = "0.5.23") -> Path:
    """An executable that answers dsv4rl's interpreter probe as an SGLang environment would."""
    from dsv4rl.launcher.engine_python import _PROBE_MARK

    answer = json.dumps({"executable": "fake", "python": "3.11.7", "torch": torch, "sglang": sglang})
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\necho '{_PROBE_MARK}{answer}'\n")
    path.chmod(0o755)
    return path


def test_plan_refuses_an_sglang_interpreter_that_cannot_serve_the_run(tmp_path: Path) -> None:
    from dsv4rl.launcher.engine_python import probe_interpreter, trainer_torch

    probe_interpreter.cache_clear()
    for name in ("other_torch", "old_sglang", "good"):
        (tmp_path / name).mkdir()
    other_torch = fake_interpreter(tmp_path / "other_torch", torch="2.99.0")
    old_sglang = fake_interpreter(tmp_path / "old_sglang", torch=trainer_torch(), sglang="0.5.22")
    cases = {
        str(tmp_path / "missing" / "python"): "cannot run (no such file)",
        sys.executable: "sglang is not installed",  # the trainer's own environment has no SGLang
        str(other_torch): f"runs torch 2.99.0 but the trainer runs torch {trainer_torch()}",
        str(old_sglang): "has sglang 0.5.22, but dsv4rl's engine contract is pinned to 0.5.23",
    }
    for python, message in cases.items():
        result = runner.invoke(
            app, ["plan", "recipe=dapo_math", "--all-nodes", *DAPO_ADDRS, f"engine.python={python}"]
        )
        assert result.exit_code == 2, result.output
        assert message in " ".join(result.output.split()) and "--skip-engine-check" in result.output
        skipped = runner.invoke(
            app,
            [
                "plan",
                "recipe=dapo_math",
                "--all-nodes",
                *DAPO_ADDRS,
                f"engine.python={python}",
                "--skip-engine-check",
            ],
        )
        assert skipped.exit_code == 0, skipped.output
    good = fake_interpreter(tmp_path / "good", torch=trainer_torch())
    plan = plan_json("recipe=dapo_math", "--all-nodes", *DAPO_ADDRS, f"engine.python={good}")
    assert plan["engine"]["python"] == str(good)
    assert plan["nodes"][2]["processes"][0]["argv"][0] == str(good)


def test_train_refuses_a_missing_sglang_interpreter_before_anything_starts(
    supervisor: list[Config], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dsv4rl.cli.validate", lambda cfg, check_paths: None)  # a CPU machine: no GPUs
    result = runner.invoke(
        app,
        [
            "train", "recipe=tiny_arith", "parallel.rollout.engine=sglang", f"run.dir={tmp_path / 'run'}",
            f"engine.python={tmp_path / 'nope'}",
        ],
    )  # fmt: skip
    assert result.exit_code == 2 and "cannot run (no such file)" in result.output
    assert supervisor == [] and not (tmp_path / "run").exists()


def test_plan_dapo_math_all_nodes(supervisor: list[Config]) -> None:
    plan = plan_json("recipe=dapo_math", "--all-nodes", *DAPO_ADDRS, "--skip-engine-check")
    assert supervisor == []  # nothing started
    assert plan["engine"]["python"].endswith(".venv-sglang/bin/python")
    assert plan["engine"]["keys_file"].endswith("runs/dapo_math/engine-keys.yaml")
    assert plan["engine"]["weight_sync_timeout_s"] == 1800.0
    nodes = plan["nodes"]
    assert [n["node"] for n in nodes] == [0, 1, 2, 3] and plan["nnodes"] == 4
    assert (
        plan["quant"]["name"] == "fp8_rollout"
        and plan["quant"]["engine_env"]["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
    )
    for node in nodes[:2]:
        (trainer,) = node["processes"]
        argv = trainer["argv"]
        assert trainer["role"] == "trainer" and argv[1:3] == ["-m", "dsv4rl.train.torchrun"]
        assert (_flag(argv, "--nnodes"), _flag(argv, "--nproc-per-node")) == ("2", "8")
        assert _flag(argv, "--node-rank") == str(node["node"]) and _flag(argv, "--master-addr") == "gpu-a01"
        assert "DSV4RL_ENGINE_URLS" not in trainer["env"]  # the trainer reads the topology from its config
        assert len(node["waits_for"]) == 2
    for node in nodes[2:]:
        engines = node["processes"]
        assert [e["role"] for e in engines] == ["engine"]  # one TP8 engine per rollout node
        assert [e["gpus"] for e in engines] == ["0..7"] and [e["port"] for e in engines] == [30000]
        for e in engines:
            assert (
                e["argv"][1:3] == ["-m", "sglang.launch_server"] and e["python"] == plan["engine"]["python"]
            )
            assert _flag(e["argv"], "--config") == plan["engine"]["keys_file"]
            assert e["env"]["DSV4RL_WEIGHT_SYNC_TIMEOUT_S"] == "1800"
            assert e["env"]["PYTHONPATH"].endswith("engine/sglang_site")
            assert (_flag(e["argv"], "--tp-size"), _flag(e["argv"], "--ep-size")) == ("8", "1")
            assert _flag(e["argv"], "--host") == "0.0.0.0"
            assert e["env"]["NCCL_MIN_NCHANNELS"] == "16" and "SGLANG_DSV4_FP4_EXPERTS" not in e["env"]
            env = e["env"]  # quant=fp8_rollout's engine environment (quant.engine_env)
            assert env["SGLANG_DSV4_FP4_DEQUANT"] == "1" and env["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
            assert "PATH" not in e["env"]  # only what the recipe and the plan set
            # --dtype and the MoE backend on every SGLang engine (auto: SGLANG_DSV4_FP4_DEQUANT demands it)
            flags = (_flag(e["argv"], "--dtype"), _flag(e["argv"], "--moe-runner-backend"))
            assert flags == ("bfloat16", "auto")
            assert e["dtype"] == "bfloat16" and e["moe"]["moe_runner_backend"] == "auto"
            assert (e["moe"]["resolves_to"], e["moe"]["expert_scale_dtype"]) == ("aiter", "float32")
    assert [e["url"] for e in plan["engines"]] == ["http://gpu-a03:30000", "http://gpu-a04:30000"]
    assert any("model.path" in w for w in plan["warnings"])  # no checkpoint on this machine


def test_plan_without_node_addrs_says_what_is_unresolved() -> None:
    plan = plan_json("recipe=dapo_math", "--node-rank", "0")
    (node,) = plan["nodes"]
    assert node["waits_for"] is None
    assert any("cluster.node_addrs is empty" in w for w in plan["warnings"])
    result = runner.invoke(app, ["plan", "recipe=dapo_math", "--node-rank", "0"])
    assert result.exit_code == 0, result.output
    assert "unresolved (set cluster.node_addrs)" in result.output and "dsv4rl.train.torchrun" in result.output


def test_plan_tiny_arith_table() -> None:
    plan = plan_json("recipe=tiny_arith")
    (node,) = plan["nodes"]
    assert [p["name"] for p in node["processes"]] == ["engine-0", "trainer"]
    assert plan["engines"][0]["url"] == "http://127.0.0.1:30000"
    assert plan["warnings"] == []
    result = runner.invoke(app, ["plan", "recipe=tiny_arith", "parallel=cpu_fsdp2"])
    assert result.exit_code == 0, result.output
    for text in (
        "node 0",
        "dsv4rl.engine",
        "--nproc-per-node 2",
        "PYTHONUNBUFFERED=1",
        "29600 (weight sync)",
    ):
        assert text in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["recipe=tiny_arith", "--node-rank", "3"], "--node-rank 3 is outside 0..0"),
        (["recipe=dapo_math", "--node-rank", "1", "--all-nodes"], "exclude each other"),
        (["recipe=tiny_arith", "algo.group_size=1"], "algo.group_size=1"),
    ],
)
def test_plan_errors_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_align_runs_the_align_task_in_its_own_dir_and_prints_the_report(monkeypatch, tmp_path) -> None:
    """`dsv4rl align --json` prints exactly the report the align task wrote (a fake run here)."""
    seen: list[tuple[Config, str]] = []

    def run_training(cfg: Config, *, console, task: str) -> int:
        seen.append((cfg, task))
        report = {"quant": cfg.quant.name.value, "mean_abs_diff": 0.01, "tokens": 3}
        (tmp_path / "align" / "fp8_mxfp4").mkdir(parents=True)
        (tmp_path / "align" / "fp8_mxfp4" / "align.json").write_text(json.dumps(report))
        return 0

    monkeypatch.setattr(dsv4rl.launcher.run, "run_training", run_training)
    result = runner.invoke(
        app, ["align", "recipe=tiny_arith", "quant=fp8_mxfp4", f"run.dir={tmp_path}", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["mean_abs_diff"] == 0.01
    ((cfg, task),) = seen
    assert task == "align" and cfg.run.dir == str(tmp_path / "align" / "fp8_mxfp4")


def test_align_refuses_a_checkpoint_in_another_format_before_starting(tmp_path, monkeypatch) -> None:
    from dsv4rl.config.choices import QuantMode
    from dsv4rl.config.model_schema import ModelConfig
    from dsv4rl.config.schema import QuantConfig
    from dsv4rl.model.model_dir import materialize_model

    monkeypatch.chdir(tmp_path)  # the default run.dir is relative
    path = materialize_model(ModelConfig(), str(tmp_path / "m"), QuantConfig(name=QuantMode.bf16))
    result = runner.invoke(
        app,
        ["align", "recipe=tiny_arith", "quant=fp8_mxfp4", f"model.path={path}", f"model.tokenizer={path}"],
    )
    assert result.exit_code == 2
    assert "holds bf16" in result.output and "set quant=bf16" in result.output
    assert not (tmp_path / "runs").exists()


def test_prompts_shows_the_tiny_prompts_in_the_chat_format() -> None:
    result = runner.invoke(
        app, ["prompts", "recipe=tiny_arith", "data.chat_format=deepseek_v4", "--n", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    first = report["prompts"][0]
    assert set(first) == {"id", "text", "ids", "tokens"} and len(report["prompts"]) == 2
    assert first["text"].startswith("<bos><｜User｜>") and first["text"].endswith("<｜Assistant｜></think>")
    assert first["tokens"] == len(first["ids"]) == 8
    assert report["lengths"]["count"] == 16 and report["lengths"]["max"] == 8 and report["dropped"] == 0
    table = runner.invoke(app, ["prompts", "recipe=tiny_arith", "data.max_prompt_len=4"])
    assert table.exit_code == 0, table.output
    assert "prompt length in tokens" in table.output and "dropped" in table.output


@needs_data
def test_prompts_of_dapo_math_equal_deepseek_recipe_ids() -> None:
    """The issue's acceptance on DAPO-Math's first rows (its 300-row sample: the parquet takes a minute)."""
    import deepseek_recipe

    from dsv4rl.model.tokenizer_files import deepseek_v4_tokenizer_dir

    sample = DATA / "dapo_math_17k_sample300.jsonl"
    argv = ["prompts", "recipe=dapo_math", f"data.path={sample}", "data.holdout=0", "--n", "2", "--json"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["lengths"]["count"] == 300 and report["tokenizer"] == "deepseek_v4"
    special = deepseek_recipe.SpecialTokens(image="<｜deepseek_image｜>")
    tokenizer = deepseek_recipe.Tokenizer.from_file(str(deepseek_v4_tokenizer_dir() / "tokenizer.json"))
    encoding = deepseek_recipe.DeepseekV4Encoding().with_special_tokens(special).with_tokenizer(tokenizer)
    options = deepseek_recipe.ConversionOptions().with_special_tokens(special)
    rows = [json.loads(line) for line in sample.read_text().splitlines()[:2]]
    for row, prompt in zip(rows, report["prompts"], strict=True):
        assert prompt["text"].startswith("<｜begin▁of▁sentence｜>") and "<｜User｜>" in prompt["text"]
        assert prompt["text"].endswith("<｜Assistant｜><think>")
        body = {"model": "DeepSeek-V4-Pro", "messages": row["prompt"], "thinking": {"type": "enabled"},
                "reasoning_effort": "low"}  # fmt: skip
        conversation = deepseek_recipe.ChatCompletionRequest(body).convert(options).conversation
        assert prompt["ids"] == encoding.encode(conversation)


def test_prompts_refuses_a_missing_data_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["prompts", "recipe=dapo_math", f"data.path={tmp_path / 'none.parquet'}"])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_plan_shows_the_reward_and_its_judge() -> None:
    """The judge is an engine the user starts (on GPUs of its own): `dsv4rl plan` lists it as external."""
    result = runner.invoke(app, ["plan", "recipe=examples/judge.yaml", "--json"])
    assert result.exit_code == 0, result.output
    reward = json.loads(result.output)["reward"]
    assert [f["name"] for f in reward["functions"]] == ["correct"]
    assert (
        reward["judge"]["model"] == "tiny_dsv4"
        and "dsv4rl does not start it" in reward["judge"]["started_by"]
    )
    shown = runner.invoke(app, ["plan", "recipe=examples/judge.yaml"])
    assert "0.1 x judge = judge tiny_dsv4 at http://127.0.0.1:30000" in shown.output
