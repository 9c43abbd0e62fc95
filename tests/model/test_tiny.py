from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.tiny import load_model, tiny_hf_config
from dsv4rl.model.tokenizer import build_char_tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def model() -> DeepseekV4ForCausalLM:
    return load_model(ModelConfig())


def test_tokenizer_round_trips_and_knows_its_specials() -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer("12+3=15", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7
    assert tokenizer.decode(ids) == "12+3=15"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert tokenizer.decode([*ids, 1], skip_special_tokens=True) == "12+3=15"
    assert tokenizer("x", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_tokenizer_rejects_repeated_alphabet() -> None:
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer("0012")


def test_every_layer_type_is_built(model: DeepseekV4ForCausalLM) -> None:
    assert model.config.layer_types == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert model.config.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert model.config.hc_mult == 4
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())


def test_hash_routing_table_is_not_all_zero(model: DeepseekV4ForCausalLM) -> None:
    table = model.model.layers[0].mlp.gate.tid2eid
    assert table.dtype == torch.int64
    assert table.shape == (model.config.vocab_size, model.config.num_experts_per_tok)
    assert all(len(set(row.tolist())) == model.config.num_experts_per_tok for row in table)
    assert len(table.unique()) == model.config.n_routed_experts


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    first, again, other = (load_model(ModelConfig(init_seed=seed)) for seed in (3, 3, 4))
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_compressed_layers_emit_entries_on_short_sequences(model: DeepseekV4ForCausalLM) -> None:
    """HCA at its checkpoint rate (128) would emit nothing for a 12-token arithmetic prompt."""
    ids = torch.randint(4, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    csa, hca = cache.layers[1], cache.layers[2]
    assert csa.compressed_kv["compressor"].shape[1] == 3
    assert csa.compressed_kv["indexer"].shape[1] == 3
    assert hca.compressed_kv["compressor"].shape[1] == 3


def test_cached_decoding_equals_a_full_forward(model: DeepseekV4ForCausalLM) -> None:
    """What lets the engine's log-probs equal the trainer's: index_topk >= length / CSA rate."""
    ids = torch.randint(4, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :7], use_cache=True)
        cache, pieces = out.past_key_values, [out.logits]
        for position in range(7, ids.shape[1]):
            out = model(ids[:, position : position + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            pieces.append(out.logits)
    assert (full - torch.cat(pieces, dim=1)).abs().max().item() < 1e-5


def test_changing_a_layer_changes_the_output(model: DeepseekV4ForCausalLM) -> None:
    """Each layer type really does work: perturbing its compressor changes the logits."""
    ids = torch.randint(4, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
        for layer in (1, 2):
            compressor = model.model.layers[layer].self_attn.compressor
            saved = compressor.kv_proj.weight.clone()
            compressor.kv_proj.weight.copy_(torch.randn_like(saved))  # a scale alone is normed away
            after = model(ids).logits
            compressor.kv_proj.weight.copy_(saved)
            assert (after - before).abs().max().item() > 1e-4, f"layer {layer} compressor has no effect"


def test_layer_type_errors_name_the_choices() -> None:
    with pytest.raises(ValueError, match="choose from"):
        tiny_hf_config(TinyModelConfig(layer_types=["sliding_attention", "global", "sliding_attention"]), 27)
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        tiny_hf_config(TinyModelConfig(num_hidden_layers=2), 27)


def test_materialized_directory_loads_back_identically(tmp_path) -> None:
    config = ModelConfig()
    path = materialize_model(config, str(tmp_path / "model"))
    loaded = load_model(ModelConfig(path=path))
    built = load_model(config)
    for name, tensor in built.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert loaded.config._attn_implementation == "eager"
    assert load_tokenizer(ModelConfig(tokenizer=path))("1+2=", add_special_tokens=False)["input_ids"] == [
        5,
        14,
        6,
        18,
    ]
    assert not (tmp_path / "model.partial").exists()


def test_a_node_that_builds_second_keeps_the_first_copy(tmp_path, monkeypatch) -> None:
    """Nodes sharing a run dir build the tiny model at once, each in its own directory: the one that
    finishes second drops its copy (same seed, same files) instead of failing. Builds interrupted earlier
    on this host are removed; another host's build in progress is left alone."""
    import socket
    import subprocess

    from dsv4rl.model import model_dir

    config, target = ModelConfig(), tmp_path / "model"
    materialize_model(config, str(target))  # the first node
    finished = subprocess.Popen(["true"])
    finished.wait()
    interrupted = f"model.partial-{socket.gethostname()}-{finished.pid}"
    for name in ("model.partial", interrupted, "model.partial-n7-1"):
        (tmp_path / name).mkdir()
    real_check, checks = model_dir.check_model_dir, []

    def looked_too_early(*args):  # the second node looked before the first node's rename
        checks.append(args)
        return False if len(checks) == 1 else real_check(*args)

    monkeypatch.setattr(model_dir, "check_model_dir", looked_too_early)
    assert materialize_model(config, str(target)) == str(target)
    assert len(checks) == 2  # the rename failed and the first copy was checked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.partial-n7-1"]
