"""Verification after a sync: a bucket corrupted on the wire stops the run in every quant mode.

The corruption happens in the transport (every byte of the bucket holding `head.weight` XORed), after
the trainer recorded what it meant to send: what a wrong offset, a race or a broken link would do.
"""

from __future__ import annotations

import asyncio
import math
import re

import pytest
import torch
from sync_helpers import TRAINER_SEED, trainer_model

from dsv4rl.config.choices import QuantMode, RolloutEngineKind
from dsv4rl.config.schema import QuantConfig, SyncConfig, SyncVerifyConfig
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.sync.served_format import check_served_formats
from dsv4rl.sync.verify import (
    PROBE_BOUNDS,
    SyncVerificationError,
    SyncVerifier,
    checksum_problems,
    engine_input_logprobs,
    probe_sequences,
)
from dsv4rl.sync.weight_sync import WeightSync
from free_ports import free_port

TARGET = "head.weight"


class CorruptingTransport:
    """Sends the bucket holding TARGET with every byte flipped; everything else passes through."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def send(self, bucket, weight_version, what, **options):
        if any(name == TARGET for name, _ in bucket):
            bucket = [(name, _flip(tensor)) for name, tensor in bucket]
        return self.inner.send(bucket, weight_version, what, **options)


def _flip(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8) ^ 0x5A
    return flat.view(tensor.dtype).reshape(tensor.shape)


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(model(ids).logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_checksum_problems_name_changed_unknown_and_stale_tensors():
    sent = {"a": "1", "b": "2", "c": "3"}
    assert checksum_problems(sent, dict(sent)) == []
    problems = checksum_problems(sent, {"a": "1", "b": "X", "d": "4"})
    assert problems == [
        "1 tensors differ from what was sent: ['b']",
        "1 tensors sent are not held by the engine: ['c']",
        "1 tensors the engine holds were never sent (left stale): ['d']",
    ]


def test_probe_sequences_are_fixed_and_parsed():
    first, again = probe_sequences(27, 4, 16, bos=0), probe_sequences(27, 4, 16, bos=0)
    assert torch.equal(first, again) and (first[:, 0] == 0).all() and first.max() < 27
    outputs = [{"meta_info": {"input_token_logprobs": [[None, 0, None], [-1.5, 3, None], [-0.5, 4, None]]}}]
    assert engine_input_logprobs(outputs, 3).tolist() == [[-1.5, -0.5]]
    with pytest.raises(SyncVerificationError, match="one per token"):
        engine_input_logprobs(outputs, 4)


@pytest.mark.parametrize("mode", list(QuantMode))
def test_a_corrupted_bucket_is_caught_by_checksum_and_by_probe(quantized_engines, mode) -> None:
    url = quantized_engines[mode]
    model = trainer_model(TRAINER_SEED + 10)
    probe = probe_sequences(27, 8, 32, bos=0)
    expected = trainer_logprobs(model, probe)
    loop = asyncio.new_event_loop()
    client = EngineClient(url, timeout_s=60)
    sync = WeightSync([client], SyncConfig(bucket_bytes=4096, timeout_s=60), "gloo", "127.0.0.1", free_port())
    verifier = SyncVerifier([client], SyncVerifyConfig(checksum=True, logprob_probe=True), mode, loop)
    try:
        sync.connect()
        sync.wire_format = check_served_formats(
            [client], QuantConfig(name=mode), RolloutEngineKind.reference, {}, "/nonexistent", loop
        )
        honest = sync.push(model.state_dict().items(), "honest", record_checksums=True)
        assert verifier.check_checksums(honest.checksums, 1) == {
            "verify_checksum_tensors": len(honest.checksums)
        }
        measured = verifier.check_probe(probe, expected, 1)["verify_probe_abs_diff"]
        assert measured <= PROBE_BOUNDS[mode] / 20, f"an honest {mode.value} sync measured {measured}"

        sync.transport = CorruptingTransport(sync.transport)
        corrupted = sync.push(model.state_dict().items(), "corrupted", record_checksums=True)
        assert corrupted.checksums == honest.checksums  # what the trainer meant to send
        with pytest.raises(
            SyncVerificationError,
            match=r"step 2 failed verification by checksum.*differ from what was sent: \[.*'head\.weight'",
        ):
            verifier.check_checksums(corrupted.checksums, 2)
        with pytest.raises(SyncVerificationError, match="step 2 failed the log-prob probe") as error:
            verifier.check_probe(probe, expected, 2)
        mean = float(re.search(r"\| log-prob (\S+), max", str(error.value)).group(1))
        assert math.isnan(mean) or mean > PROBE_BOUNDS[mode]
    finally:
        sync.close()
        loop.run_until_complete(client.aclose())
        loop.close()
