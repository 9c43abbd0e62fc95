"""`dsv4rl align --attribute`'s trainer side: the sequences are sampled once and reused, the engine's
scoring becomes the batch, and the trainer's features switch on and off between forwards (one rank,
in-process fsdp backend)."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dsv4rl.algo.grpo import token_logprobs
from dsv4rl.config.choices import AlignFeature, NumericsFeature
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.naming import hf_to_native
from dsv4rl.model.native_checkpoint import load_native_model
from dsv4rl.model.sglang_numerics import apply_sglang_numerics, served_weight
from dsv4rl.rollout.choices import ChoiceRequest
from dsv4rl.samples import Sample
from dsv4rl.train.attribute import fixed_sequences, scored_sample, trainer_features, trainer_logprobs
from dsv4rl.train.batch import TrainBatch

F = AlignFeature
TRAINER_ROUNDING = {F.kv_fp8, F.bf16_weights, F.bf16_activations, F.mhc_tf32, F.router_bf16_input}


def test_the_sequences_are_sampled_once_and_reused(tmp_path: Path) -> None:
    calls = []

    def sample() -> list[tuple[list[int], list[int]]]:
        calls.append(1)
        return [([1, 5, 6], [7, 8]), ([1, 4], [9])]

    path = tmp_path / "attribute_sequences.json"
    first = fixed_sequences(path, sample)
    second = fixed_sequences(path, sample)  # the second engine start
    assert first == second == [([1, 5, 6], [7, 8]), ([1, 4], [9])]
    assert len(calls) == 1


def encoded(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype("<i4").tobytes()).decode()


def test_the_engines_scoring_becomes_the_samples_log_probs_and_choices() -> None:
    prompt, response = [1, 5, 6], [7, 8]
    routes = np.arange(4 * 6).reshape(4, 6)  # prompt + response - 1 forwarded positions
    answer = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 5, None], [-0.25, 6, None],
                                                     [-1.5, 7, None], [-2.5, 8, None]],
                            "routed_experts": encoded(routes)}}  # fmt: skip
    sample = scored_sample(prompt, response, answer, ChoiceRequest(routed_experts=True))
    assert sample.rollout_logprobs == [-1.5, -2.5]  # the response tokens' input log-probs
    assert np.array_equal(sample.routed_experts, routes) and sample.indexer_topk is None
    short = {"meta_info": {"input_token_logprobs": answer["meta_info"]["input_token_logprobs"][:4]}}
    with pytest.raises(ValueError, match="4 input log-probs for a 5-token sequence"):
        scored_sample(prompt, response, short, ChoiceRequest())


@pytest.fixture
def world_of_one(tmp_path: Path):  # noqa: ANN201
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def engine_emulation(path: str) -> torch.nn.Module:
    """The reference engine's model with engine.numerics=sglang on quant=none (fp32 LM head): bf16 weights
    where SGLang holds bf16, every rounding point."""
    model = load_native_model(path, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            native = next(iter(hf_to_native(name, param)))[0]
            param.copy_(served_weight(native, param))
    features = set(NumericsFeature) - {NumericsFeature.act_fp8, NumericsFeature.bf16_logits}
    apply_sglang_numerics(model, features - {NumericsFeature.bf16_weights})
    return model.eval()


def test_trainer_features_switch_between_forwards(world_of_one, tmp_path: Path) -> None:
    from dsv4rl.train.fsdp.backend import FSDPBackend

    cfg = Config()
    cfg.train.micro_batch_size = 2  # three micro-batches for five sequences
    path = materialize_model(ModelConfig(), str(tmp_path / "model"))
    backend = FSDPBackend(cfg, path, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    samples = []
    for length in (30, 26, 34, 22, 30):
        ids = torch.randint(3, 20, (length,), generator=generator).tolist()
        samples.append(Sample(0, ids[:10], ids[10:], [0.0] * (length - 10), "", "stop"))
    batch = TrainBatch.from_samples(samples, pad_id=0)
    mask = batch.loss_mask.bool()

    exact = trainer_logprobs(backend, batch)
    whole = backend.compute_logprobs(batch.input_ids)
    assert torch.allclose(exact[mask], whole[mask], atol=1e-6)  # the micro-batches put back in place

    engine = engine_emulation(path)
    with torch.no_grad():
        engine_lp = token_logprobs(engine(input_ids=batch.input_ids, use_cache=False).logits, batch.input_ids)
    configuration = frozenset(TRAINER_ROUNDING | {F.routing_replay})
    with trainer_features(backend, cfg, configuration):
        assert backend.cfg.algo.routing_replay and not backend.cfg.algo.indexer_replay
        with pytest.raises(ValueError, match="no routed_experts"):  # the replay reads the batch's choices
            trainer_logprobs(backend, batch)
    with trainer_features(backend, cfg, frozenset(TRAINER_ROUNDING)):
        aligned = trainer_logprobs(backend, batch)
    assert backend.cfg is cfg and not cfg.algo.routing_replay  # restored
    before = (exact - engine_lp)[mask].abs().mean()
    after = (aligned - engine_lp)[mask].abs().mean()
    assert before > 1e-4 and after < before / 100, (before, after)
    assert torch.equal(trainer_logprobs(backend, batch), exact)  # the rounding came off, weights restored
