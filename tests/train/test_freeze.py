"""`train.freeze`: its entries (groups and patterns on transformers' names) against the real tiny model,
the refusals, the freeze itself and its optimizer, the fingerprint check before checkpoints; and both
trainer backends built with the reference run's groups frozen (freeze_scenarios.py, under torchrun)."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import FreezeGroup
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import Config
from dsv4rl.model.freeze import FreezeError, entry_problems, parse_entries
from dsv4rl.model.tiny import build_tiny_model
from dsv4rl.model.tokenizer import load_tokenizer
from dsv4rl.train.freeze import FrozenTensorChanged, fingerprint, freeze
from dsv4rl.train.weight_decay import param_groups

SCRIPT = Path(__file__).with_name("freeze_scenarios.py")
TIMEOUT_S = 300
# the tiny model: layer 0 hash-routed (a gate weight, no correction bias), layers 1 and 2 score-routed
GATES = [f"model.layers.{layer}.mlp.gate.weight" for layer in range(3)]
BIASES = [f"model.layers.{layer}.mlp.gate.e_score_correction_bias" for layer in (1, 2)]
MEGATRON_GATES = [f"decoder.layers.{layer}.mlp.router.weight" for layer in range(3)]
MEGATRON_BIASES = [f"decoder.layers.{layer}.mlp.router.expert_bias" for layer in (1, 2)]


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    cfg = Config()
    return build_tiny_model(cfg.model, len(load_tokenizer(cfg.model))).train()


def tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.state_dict(keep_vars=True).items())


def selected(model: torch.nn.Module, entry: str) -> list[str]:
    (rule,) = parse_entries([entry])
    return sorted(name for name in model.state_dict() if rule.matches(name))


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        (["router_gate"], GATES),
        (["router_bias"], BIASES),
        (["glob:model.layers.*.mlp.gate.weight"], GATES),
        (["re:model\\.layers\\.\\d+\\.mlp\\.gate\\.e_score_correction_bias"], BIASES),
        (["glob:*.mlp.gate.*"], sorted([*GATES, *BIASES, "model.layers.0.mlp.gate.tid2eid"])),
    ],
)
def test_entries_select_transformers_names_of_the_tiny_model(tiny_model, entries, expected) -> None:
    assert selected(tiny_model, entries[0]) == expected


def test_a_pattern_matches_the_whole_name() -> None:
    (rule,) = parse_entries(["re:mlp\\.gate\\.weight"])
    assert not rule.matches("model.layers.1.mlp.gate.weight")
    (rule,) = parse_entries(["glob:model.layers.1.*"])
    assert rule.matches("model.layers.1.mlp.gate.weight") and not rule.matches(
        "model.layers.11.mlp.gate.weight"
    )


@pytest.fixture(scope="module")
def tiny_recipe() -> Config:
    return compose("tiny_arith")


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ("router_gates", "neither a group (router_gate, router_bias) nor a pattern"),
        ("model.layers.0.mlp.gate.weight", "`glob:model.layers.*.mlp.gate.weight`"),
        ("glob:", "has an empty pattern"),
        ("re:model.layers.(", "is not a regular expression (missing ), unterminated subpattern"),
    ],
)
def test_unusable_entries_are_refused_by_validation(tiny_recipe: Config, entry: str, fragment: str) -> None:
    cfg = copy.deepcopy(tiny_recipe)
    cfg.train.freeze = ["router_gate", entry]
    with pytest.raises(ConfigError) as error:
        validate(cfg, check_paths=False)
    assert f"train.freeze entry {entry!r}" in str(error.value) and fragment in str(error.value)


def test_the_reference_runs_groups_pass_validation_and_a_repeat_does_not(tiny_recipe: Config) -> None:
    cfg = copy.deepcopy(tiny_recipe)
    cfg.train.freeze = ["router_gate", "router_bias"]
    validate(cfg, check_paths=False)
    assert list(FreezeGroup) == ["router_gate", "router_bias"]
    assert entry_problems(["router_bias", "router_bias"]) == ["train.freeze lists 'router_bias' twice"]


def test_freeze_turns_off_gradients_and_adam_holds_no_state_for_frozen_tensors(tiny_model) -> None:
    """On one process the freeze is what each backend does before its optimizer: the model's own tensors,
    a step of torch's AdamW, and nothing moves what is frozen."""
    frozen = freeze(tensors(tiny_model), ["router_gate", "router_bias"], lambda name: (name,), lambda _: True)
    assert sorted(frozen.names) == sorted([*GATES, *BIASES]) and frozen.everywhere == {*GATES, *BIASES}
    assert {entry: (c.tensors, c.elements) for entry, c in frozen.counts.items()} == {
        "router_gate": (3, 3 * 8 * 64),  # experts x hidden per layer
        "router_bias": (2, 2 * 8),
    }
    parameters = dict(tiny_model.named_parameters())
    assert [name for name in GATES if parameters[name].requires_grad] == []
    before = {name: tensor.detach().clone() for name, tensor in tiny_model.state_dict().items()}
    optimizer = torch.optim.AdamW(param_groups(tiny_model.named_parameters(), 0.1), lr=1e-2)
    ids = torch.randint(4, 27, (2, 12), generator=torch.Generator().manual_seed(0))
    tiny_model(input_ids=ids, use_cache=False).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    names = {id(p): name for name, p in tiny_model.named_parameters()}
    stateful = {names[id(p)] for p, state in optimizer.state.items() if state}
    assert stateful and not stateful & set(GATES)
    assert all(parameters[name].grad is None for name in GATES)
    after = tiny_model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in [*GATES, *BIASES])
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    frozen.snapshot([*tiny_model.named_parameters(), *tiny_model.named_buffers()])
    frozen.check(tensors(tiny_model), "a step")
    with torch.no_grad():
        tiny_model.get_buffer(BIASES[0]).add_(0.5)
    with pytest.raises(FrozenTensorChanged, match=f"{BIASES[0]} \\(frozen by train.freeze=router_bias\\)"):
        frozen.check(tensors(tiny_model), "step 3's checkpoint")


@pytest.fixture
def fresh_model() -> torch.nn.Module:
    cfg = Config()
    return build_tiny_model(cfg.model, len(load_tokenizer(cfg.model)))


def test_snapshot_must_find_every_frozen_tensor(fresh_model) -> None:
    frozen = freeze(tensors(fresh_model), ["router_bias"], lambda name: (name,), lambda _: True)
    with pytest.raises(RuntimeError, match="are not among this rank's weights"):
        frozen.snapshot(fresh_model.named_parameters())  # the biases are buffers


@pytest.mark.parametrize(
    ("entries", "fragment"),
    [
        (
            ["router_gate", "re:model\\.layers\\.9\\..*"],
            "entry 're:model\\\\.layers\\\\.9\\\\..*' matches no tensor of the model",
        ),
        (["glob:*"], "freezes every parameter of the model: nothing would train"),
    ],
)
def test_a_freeze_that_cannot_work_is_refused(fresh_model, entries, fragment) -> None:
    with pytest.raises(FreezeError) as error:
        freeze(tensors(fresh_model), entries, lambda name: (name,), lambda _: True)
    assert fragment in str(error.value)


def test_a_backend_tensor_holding_several_names_freezes_whole_or_is_refused(fresh_model) -> None:
    """As megatron's fused shared-expert tensor: both of its transformers names, or a refusal."""
    fused = (
        "model.layers.0.mlp.shared_experts.gate_proj.weight",
        "model.layers.0.mlp.shared_experts.up_proj.weight",
    )
    parameter = torch.nn.Parameter(torch.zeros(4))
    pairs = [*tensors(fresh_model), ("fc1", parameter)]

    def names(name: str) -> tuple[str, ...]:
        return fused if name == "fc1" else (name,)

    freeze(pairs, ["glob:*.shared_experts.*_proj.weight"], names, lambda _: True)
    assert not parameter.requires_grad
    with pytest.raises(
        FreezeError, match="matches only a part of what one tensor of this trainer backend holds: fc1 ="
    ):
        freeze(pairs, ["glob:*.shared_experts.up_proj.weight"], names, lambda _: True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_fingerprint_sees_one_bit_of_one_element_and_rows_swapped(dtype: torch.dtype) -> None:
    tensor = torch.arange(48).reshape(16, 3).to(dtype) * 3 - 7
    assert fingerprint(tensor) == fingerprint(tensor.clone())
    for mask in (1, -(1 << 15)):  # the lowest and the highest (sign) bit of one 16-bit piece
        flipped = tensor.clone()
        flipped.view(torch.int16)[5, 1] ^= mask
        assert fingerprint(flipped) != fingerprint(tensor), mask
    assert fingerprint(tensor[[1, 0, *range(2, 16)]]) != fingerprint(tensor)


def test_fingerprint_of_booleans() -> None:
    assert fingerprint(torch.zeros(5, dtype=torch.bool)) != fingerprint(torch.tensor([0, 0, 1, 0, 0]).bool())


# ---------------------------------------------------------------- both backends (torchrun)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def backends(tmp_path_factory) -> dict[int, dict]:
    """World 1 (both backends) and world 2 (fsdp, sharded) at once."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {}
    for world in (1, 2):
        out = tmp_path_factory.mktemp(f"freeze_w{world}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), str(SCRIPT), str(out)]  # fmt: skip
        runs[world] = (
            out,
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        )
    results = {}
    for world, (out, proc) in runs.items():
        log, _ = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, log[-6000:]
        results[world] = torch.load(out / f"results_world{world}.pt", weights_only=False)
    return results


CASES = [(1, "fsdp"), (2, "fsdp"), (1, "megatron")]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "backend"), CASES)
def test_each_backend_freezes_the_router_gates_and_biases(backends, world, backend) -> None:
    out = backends[world][backend]
    gates, biases = (GATES, BIASES) if backend == "fsdp" else (MEGATRON_GATES, MEGATRON_BIASES)
    assert out["frozen"] == {**{n: ["router_gate"] for n in gates}, **{n: ["router_bias"] for n in biases}}
    assert out["counts"] == {"router_gate": (3, 1536), "router_bias": (2, 16)}
    assert sorted(set(out["parameters"]) - set(out["trainable"])) == sorted(gates)
    # no optimizer state, no gradient, no gradient buffer, not in megatron's GPU optimizer groups
    for held in ("in_optimizer", "with_state", "gradients", "grad_buffers", "megatron_gpu_groups"):
        if held in out:
            assert out[held] and not set(out[held]) & set(gates), held
    assert set(out["in_optimizer"]) == set(out["trainable"])
    assert out.get("bias_update_out_of_reach", backend == "fsdp")  # megatron's bias balancing cannot run


@pytest.mark.slow
@pytest.mark.parametrize(("world", "backend"), CASES)
def test_frozen_tensors_are_synced_unchanged_while_the_rest_trains(backends, world, backend) -> None:
    out = backends[world][backend]
    initial, after = out["initial"], out["after"]
    assert set(initial) == set(after) and set(GATES + BIASES) <= set(after)  # the sync still sends them
    assert all(torch.equal(initial[name], after[name]) for name in GATES + BIASES)
    assert initial[BIASES[0]].dtype == torch.float32
    moved = [name for name in after if not torch.equal(initial[name], after[name])]
    assert "lm_head.weight" in moved and "model.layers.1.mlp.shared_experts.up_proj.weight" in moved
    assert len(moved) > 60


@pytest.mark.slow
@pytest.mark.parametrize(("world", "backend"), CASES)
def test_a_frozen_tensor_changed_behind_the_trainers_back_stops_the_checkpoint(
    backends, world, backend
) -> None:
    out = backends[world][backend]
    name = GATES[0] if backend == "fsdp" else MEGATRON_GATES[0]
    assert out["changed"].startswith(f"{name} (frozen by train.freeze=router_gate")
    assert "step 1's checkpoint" in out["changed"] and not out["written"]


@pytest.mark.slow
def test_megatron_refuses_an_entry_matching_half_of_its_fused_tensor(backends) -> None:
    message = backends[1]["megatron"]["partial"]
    assert "'glob:*.shared_experts.gate_proj.weight' matches only a part" in message
    assert (
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight = model.layers.0.mlp.shared_experts.gate_proj"
        in message
    )
