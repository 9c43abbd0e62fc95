"""dsv4rl against SGLang 0.5.23 as released: the committed contract (read from the wheel) and every request
the client sends, every flag the planner emits, every route, auth rule and sampling key of the reference
engine. Renaming a field, route or flag in the contract makes these checks fail (the mutation tests)."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import re
import tempfile
import zipfile
from pathlib import Path

import fastapi.routing
import httpx
import pytest
import yaml
from fastapi.routing import APIRoute

from dsv4rl.config.compose import compose
from dsv4rl.engine.args import build_parser
from dsv4rl.engine.http_util import ADMIN_PATHS
from dsv4rl.engine.protocol import SAMPLING_KEYS
from dsv4rl.engine.sglang_contract import (
    config_file_problems,
    extract_contract,
    flag_problems,
    load_contract,
    request_problems,
)
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.engine_client.engine_keys import ensure_engine_keys_file
from dsv4rl.launcher.engine_python import SGLANG_VERSION
from dsv4rl.launcher.plan import build_local_plan

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = load_contract()
# the reference engine's own knobs
REFERENCE_ONLY_FLAGS = {
    "--max-batch-size",
    "--num-threads",
    "--emulate-non-idempotent-postprocess",
    "--numerics",
    "--numerics-features",
}


# ------------------------------------------------------------------------------------------- helpers
def client_requests() -> list[tuple[str, str, dict | None, dict]]:
    """(method, path, JSON body, query) of every call EngineClient can make, optional fields included."""
    seen: list[tuple[str, str, dict | None, dict]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, body, dict(request.url.params)))
        if request.url.path == "/generate":
            return httpx.Response(200, json=[])
        return httpx.Response(200, json={"success": True, "message": "Success"})

    client = EngineClient("http://engine", transport=httpx.MockTransport(answer), retries=0)

    async def every_call() -> None:
        await client.health()
        await client.model_info()
        await client.server_info()
        await client.generate([[1, 2], [3]], {"n": 2, "sampling_seed": 3, "max_new_tokens": 4}, True, -1, "r")
        await client.generate([[1, 2]], [{"n": 1, "sampling_seed": 7, "stop_token_ids": [0]}], True)
        await client.generate([[1, 2]], {"n": 1}, True, return_routed_experts=True, return_indexer_topk=True)
        await client.abort_request("r", abort_all=False)
        await client.pause_generation("retract")
        await client.continue_generation()
        await client.flush_cache(timeout_s=5.0)
        await client.freeze_gc()
        await client.begin_weight_update()
        await client.init_weights_update_group("127.0.0.1", 29600, 1, 2, "g", "nccl")
        await client.update_weights_from_distributed(
            ["a.weight"],
            ["bfloat16"],
            [[2, 2]],
            "g",
            False,
            weight_version="3",
            load_format="flattened_bucket",
        )
        await client.update_weights_from_tensor(["cGF5bG9hZA=="], "flattened_bucket", True, "4")
        await client.end_weight_update()
        await client.release_memory_occupation(["weights", "kv_cache"])
        await client.resume_memory_occupation(None)
        await client.weights_checker("snapshot", skip_tensor_list=["embed"])
        await client.update_weight_version("3", abort_all_requests=False)
        await client.destroy_weights_update_group("g")
        await client.aclose()

    asyncio.run(every_call())
    return seen


def problems_of_client(contract: dict) -> list[str]:
    return [
        p
        for method, path, body, query in client_requests()
        for p in request_problems(contract, method, path, body, query)
    ]


def sglang_plan_argvs() -> list[list[str]]:
    """The SGLang command lines of dapo_math, and of a variant with attention DP and every optional flag."""
    variants = [
        [],
        [
            "parallel.rollout.data_parallel=2",
            "engine.reproducible_sampling=true",
            "+engine.extra_args=[]",
            "engine.fp32_lm_head=true",
        ],
        ["algo.routing_replay=true", "algo.indexer_replay=true"],
    ]
    argvs = []
    for overrides in variants:
        cfg = compose("dapo_math", ["cluster.node_rank=2", "cluster.node_addrs=[a,b,c,d]", *overrides])
        for spec in build_local_plan(cfg, Path("/tmp/run"), base_env={}, model_path="/models/flash"):
            if spec.role == "engine":
                assert spec.argv[1:3] == ["-m", "sglang.launch_server"]
                argvs.append(spec.argv[3:])
    return argvs


def problems_of_planner(contract: dict) -> list[str]:
    problems = [p for argv in sglang_plan_argvs() for p in flag_problems(contract, argv)]
    with tempfile.TemporaryDirectory() as run_dir:  # the keys file exactly as dsv4rl writes it
        keys = yaml.safe_load(ensure_engine_keys_file(Path(run_dir), env={}).read_text())
    return problems + config_file_problems(contract, keys)


def served_routes(app) -> dict[str, set[str]]:
    """{path: methods} of every API route the app serves. FastAPI 0.137+ keeps an included router's routes
    behind one node of `app.routes`; `iter_route_contexts` (0.137.2+) lists them, older versions flatten."""
    iter_contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    if iter_contexts is None:
        return {route.path: set(route.methods) for route in app.routes if isinstance(route, APIRoute)}
    return {
        context.path: set(context.methods)
        for context in iter_contexts(app.routes)
        if isinstance(context.original_route, APIRoute)
    }


def problems_of_reference_engine(contract: dict, app) -> list[str]:
    problems = []
    reference_routes = served_routes(app)
    for path, methods in sorted(reference_routes.items()):
        route = contract["routes"].get(path)
        if route is None:
            problems.append(f"reference route {path} is not an SGLang route")
        elif methods != set(route["methods"]):
            problems.append(f"reference route {path}: methods {sorted(methods)}, SGLang {route['methods']}")
    admin = {p for p in reference_routes if contract["routes"].get(p, {}).get("auth") == "admin_optional"}
    if admin != set(ADMIN_PATHS) & set(reference_routes):
        problems.append(f"admin routes differ: reference {sorted(ADMIN_PATHS)}, SGLang {sorted(admin)}")
    if missing := sorted(set(ADMIN_PATHS) - set(reference_routes)):
        problems.append(f"ADMIN_PATHS lists routes the reference engine does not serve: {missing}")
    sglang_keys = set(contract["sampling_params"])
    if set(SAMPLING_KEYS) != sglang_keys:
        problems.append(
            f"sampling keys differ: reference-only {sorted(set(SAMPLING_KEYS) - sglang_keys)}, "
            f"SGLang-only {sorted(sglang_keys - set(SAMPLING_KEYS))}"
        )
    index = {alias for name, spec in contract["server_flags"].items() for alias in [name, *spec["aliases"]]}
    for action in build_parser()._actions:
        for option in action.option_strings:
            if (
                option.startswith("--")
                and option not in index
                and option not in REFERENCE_ONLY_FLAGS | {"--help"}
            ):
                problems.append(f"reference engine flag {option} is not an SGLang flag")
    return problems


def renamed(path: list[str], new_key: str) -> dict:
    """The contract with the entry at `path` moved to `new_key`."""
    contract = copy.deepcopy(CONTRACT)
    parent = contract
    for key in path[:-1]:
        parent = parent[key]
    parent[new_key] = parent.pop(path[-1])
    return contract


# ------------------------------------------------------------------------------------------- the contract
def test_contract_is_for_the_pinned_release_and_its_torch() -> None:
    assert CONTRACT["sglang"] == SGLANG_VERSION
    torch_pin = CONTRACT["requires"]["torch"]
    makefile = (ROOT / "Makefile").read_text()
    gpu_torch = re.search(r"GPU_TORCH_SPEC \?= (\S+)", makefile).group(1)
    assert gpu_torch == f"torch{torch_pin}", "make install GPU=1 must take SGLang's torch"
    assert f"sglang=={SGLANG_VERSION}" in makefile


def test_every_client_request_is_one_sglang_takes() -> None:
    requests = client_requests()
    called = {path for _, path, _, _ in requests}
    assert {
        "/generate",
        "/update_weights_from_distributed",
        "/flush_cache",
        "/weights_checker",
        "/freeze_gc",
    } <= called
    colocated = {"/update_weights_from_tensor", "/release_memory_occupation", "/resume_memory_occupation"}
    assert colocated <= called
    assert problems_of_client(CONTRACT) == []


def test_every_flag_the_planner_emits_is_an_sglang_flag_with_its_type() -> None:
    argvs = sglang_plan_argvs()
    assert any("--attn-dp-size" in argv and "--enable-deterministic-inference" in argv for argv in argvs)
    assert all("--config" in argv for argv in argvs)  # dapo_math binds 0.0.0.0: the keys file
    replaying = [
        a for a in argvs if "--enable-return-routed-experts" in a and "--enable-return-indexer-topk" in a
    ]
    assert replaying and len(replaying) < len(argvs)  # only the variant with the replays on
    assert problems_of_planner(CONTRACT) == []


def test_reference_engine_routes_auth_sampling_keys_and_flags_agree(make_client) -> None:
    app = make_client().app
    assert problems_of_reference_engine(CONTRACT, app) == []


# ------------------------------------------------------------------------------------------- mutations
@pytest.mark.parametrize(
    ("path", "new_key"),
    [
        (["bodies", "UpdateWeightsFromDistributedReqInput", "weight_version"], "weight_version_id"),
        (["bodies", "InitWeightsUpdateGroupReqInput", "rank_offset"], "rank_start"),
        (["routes", "/flush_cache"], "/flush"),
        (["routes", "/flush_cache", "query", "timeout"], "timeout_s"),
        (["sampling_params", "sampling_seed"], "seed"),
        (["generate_request", "logprob_start_len"], "logprob_start"),
        (["generate_request", "routed_experts_start_len"], "routed_start"),
        (["bodies", "GenerateReqInput", "return_routed_experts"], "return_experts"),
        (["bodies", "GenerateReqInput", "return_indexer_topk"], "return_topk"),
        (["bodies", "UpdateWeightsFromTensorReqInput", "serialized_named_tensors"], "named_tensors"),
        (["bodies", "ReleaseMemoryOccupationReqInput", "tags"], "memory_tags"),
        (["routes", "/resume_memory_occupation"], "/resume_memory"),
    ],
)
def test_a_renamed_field_or_route_fails_the_client_check(path: list[str], new_key: str) -> None:
    assert problems_of_client(renamed(path, new_key))


@pytest.mark.parametrize(
    ("flag", "new_name"),
    [
        ("--tp-size", "--tp"),
        ("--attn-dp-size", "--dp-attention-size"),
        ("--enable-deterministic-inference", "--deterministic"),
    ],
)
def test_a_renamed_flag_fails_the_planner_check(flag: str, new_name: str) -> None:
    contract = renamed(["server_flags", flag], new_name)
    contract["server_flags"][new_name]["aliases"] = []
    assert problems_of_planner(contract)


def test_the_planned_dtype_and_moe_backend_are_choices_of_the_release() -> None:
    """--dtype and --moe-runner-backend are checked against SGLang's own choice lists (the contract holds
    MOE_RUNNER_BACKEND_CHOICES of srt/arg_groups/choices.py); a value the release drops fails."""
    flags = CONTRACT["server_flags"]
    assert {"auto", "triton", "aiter", "flashinfer_mxfp4"} <= set(flags["--moe-runner-backend"]["choices"])
    assert "bfloat16" in flags["--dtype"]["choices"]
    assert all("--dtype" in argv and "--moe-runner-backend" in argv for argv in sglang_plan_argvs())
    for flag, value in (("--moe-runner-backend", "auto"), ("--dtype", "bfloat16")):
        contract = copy.deepcopy(CONTRACT)
        contract["server_flags"][flag]["choices"].remove(value)
        assert any(p.startswith(f"{flag} {value}: SGLang accepts") for p in problems_of_planner(contract))


def test_a_flag_whose_type_changes_fails_the_planner_check() -> None:
    contract = copy.deepcopy(CONTRACT)
    contract["server_flags"]["--mem-fraction-static"].update(type="int", value_type="int")
    assert any("--mem-fraction-static 0.7" in p for p in problems_of_planner(contract))


def test_a_renamed_route_or_sampling_key_fails_the_reference_check(make_client) -> None:
    app = make_client().app
    assert problems_of_reference_engine(renamed(["routes", "/pause_generation"], "/pause"), app)
    assert problems_of_reference_engine(renamed(["sampling_params", "choice"], "choices"), app)
    demoted = copy.deepcopy(CONTRACT)
    demoted["routes"]["/abort_request"]["auth"] = "normal"
    assert problems_of_reference_engine(demoted, app)


# ------------------------------------------------------------------------------------------- the extractor
def _wheel(tmp_path: Path) -> Path:
    files = {
        "sglang-9.9.9.dist-info/METADATA": "Name: sglang\nVersion: 9.9.9\nRequires-Dist: torch==2.14.1\n"
        "Requires-Dist: pytest; extra == 'test'\n",
        "sglang/srt/managers/io_struct.py": (
            "class BaseReq(msgspec.Struct):\n    rid: Optional[str] = None\n\n"
            "class PushReqInput(BaseReq, kw_only=True):\n    names: List[str]\n    flush: bool = True\n"
        ),
        "sglang/api/v1/api_types.py": (
            "class SamplingParams(msgspec.Struct):\n    n: Optional[int] = 1\n\n"
            "class GenerateRequest(msgspec.Struct):\n    input_ids: Optional[list] = None\n"
        ),
        "sglang/srt/entrypoints/http_server.py": (
            '@app.post("/push")\n@auth_level(AuthLevel.ADMIN_OPTIONAL)\n'
            "async def push(obj: Annotated[PushReqInput, Body()], request: Request):\n    pass\n\n"
            '@app.api_route("/flush", methods=["GET", "POST"])\n'
            "async def flush(timeout: float = Query(0.0)):\n    pass\n\n"
            '@app.post(os.environ.get("ROUTE", "/x"))\nasync def hidden():\n    pass\n'
        ),
        "sglang/srt/arg_groups/fields/serving.py": (
            "class Serving(msgspec.Struct):\n"
            '    port: A[int, "The port."] = 30000\n'
            '    tp_size: A[int, Arg(help="TP", aliases=["--tensor-parallel-size"])] = 1\n'
            '    fast: A[bool, "Go fast."] = False\n'
            '    hidden: A[int, Arg(help="x", no_cli=True)] = 0\n'
            '    ratio: A[Optional[float], "A ratio."] = None\n'
            '    mode: A[str, Arg(help="m", choices=MODES)] = "a"\n'
        ),
        "sglang/srt/arg_groups/choices.py": 'MODES = [\n    "a",\n    "b",\n]\nadd_modes = MODES.extend\n',
        "sglang/srt/server_args.py": 'parser.add_argument("--config", type=str, help="YAML")\n',
    }
    path = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    path.write_bytes(buffer.getvalue())
    return path


def test_extractor_reads_routes_bodies_keys_and_flags_from_a_wheel(tmp_path: Path) -> None:
    contract = extract_contract(_wheel(tmp_path))
    assert contract["sglang"] == "9.9.9" and contract["requires"] == {"torch": "==2.14.1"}
    assert contract["routes"]["/push"] == {
        "methods": ["POST"], "auth": "admin_optional", "body": "PushReqInput", "query": {}, "handler": "push",
    }  # fmt: skip
    assert contract["routes"]["/flush"]["methods"] == ["GET", "POST"]
    assert contract["routes"]["/flush"]["query"] == {"timeout": "float"}
    assert "/x" not in contract["routes"]  # a route named by the environment is not a fixed contract
    assert contract["bodies"]["PushReqInput"] == {
        "rid": {"type": "Optional[str]", "required": False, "default": None},
        "names": {"type": "List[str]", "required": True},
        "flush": {"type": "bool", "required": False, "default": True},
    }
    assert list(contract["sampling_params"]) == ["n"]
    flags = contract["server_flags"]
    assert (
        flags["--tp-size"]["aliases"] == ["--tensor-parallel-size"]
        and flags["--tp-size"]["value_type"] == "int"
    )
    assert flags["--fast"]["action"] == "store_true" and flags["--fast"]["value_type"] == "none"
    assert flags["--ratio"]["value_type"] == "float" and flags["--config"]["value_type"] == "str"
    assert "--hidden" not in flags
    assert request_problems(contract, "POST", "/push", {"names": ["a"], "flush": False}) == []
    assert request_problems(contract, "POST", "/push", {"flush": False}) == [
        "POST /push: required field 'names' missing"
    ]
    assert flag_problems(contract, ["--tensor-parallel-size", "2", "--fast", "--ratio", "0.5"]) == []
    assert flag_problems(contract, ["--port", "x"]) == ["--port x: SGLang parses it as int"]
    assert flags["--mode"]["choices"] == ["a", "b"]  # a list of srt/arg_groups/choices.py
    assert flag_problems(contract, ["--mode", "c"]) == ["--mode c: SGLang accepts ['a', 'b']"]


# ------------------------------------------------------------------------------------------- chat completions
def judge_request_problems(contract: dict) -> list[str]:
    """The judge's /v1/chat/completions body (reward.judge) against SGLang's ChatCompletionRequest."""
    from dsv4rl.config.choices import RewardOnError
    from dsv4rl.config.schema import RewardJudgeConfig
    from dsv4rl.reward.judge import CHAT_ROUTE, JudgeScorer
    from dsv4rl.reward.results import FnSpec

    judge = JudgeScorer(
        FnSpec("judge", "j", 1.0, RewardOnError.zero, 1.0), RewardJudgeConfig(base_url="http://j"), []
    )
    return request_problems(contract, "POST", CHAT_ROUTE, judge.request_body("Rate: 7"))


def test_the_judge_and_the_reference_chat_route_use_sglang_fields() -> None:
    from dsv4rl.engine.chat_routes import CHAT_FIELDS

    fields = CONTRACT["chat_completion_request"]
    assert fields["messages"]["required"] and "max_completion_tokens" in fields
    assert judge_request_problems(CONTRACT) == []
    assert sorted(set(CHAT_FIELDS) - set(fields)) == []
    assert CONTRACT["routes"]["/v1/chat/completions"]["methods"] == ["POST"]


def test_a_renamed_chat_field_fails_the_judge_check() -> None:
    problems = judge_request_problems(
        renamed(["chat_completion_request", "max_completion_tokens"], "max_new")
    )
    assert problems == [
        "POST /v1/chat/completions: field 'max_completion_tokens' is not in the body (dropped)"
    ]
