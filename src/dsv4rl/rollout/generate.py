"""Turn a step's problems into samples: prompts -> engines' /generate -> `Sample`s with rollout log-probs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dsv4rl.config.schema import SamplingConfig
from dsv4rl.data.problems import Problem
from dsv4rl.rollout.client import EngineClient
from dsv4rl.rollout.types import Sample


def sampling_params(sampling: SamplingConfig, stop_token_ids: list[int], n: int, seed: int | None) -> dict:
    """SGLang `sampling_params` (only keys its schema accepts)."""
    params: dict = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": stop_token_ids,
        "n": n,
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Prompt token ids with the model's BOS first, as DeepSeek-V4 expects."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]


def _to_sample(group: int, prompt_ids: list[int], output: dict, answer: str) -> Sample:
    meta = output["meta_info"]
    logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
    response_ids = list(output["output_ids"])
    if len(logprobs) != len(response_ids):
        raise ValueError(
            f"engine returned {len(logprobs)} logprobs for {len(response_ids)} output tokens; "
            "rollout log-probs must cover every response token"
        )
    return Sample(
        group=group,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        rollout_logprobs=logprobs,
        response_text=output.get("text", ""),
        finish_reason=meta["finish_reason"]["type"],
        answer=answer,
        weight_version=str(meta.get("weight_version", "")),
    )


async def generate_samples(
    clients: Sequence[EngineClient],
    problems: Sequence[Problem],
    tokenizer,
    group_size: int,
    sampling: SamplingConfig,
    seed: int | None = None,
) -> list[Sample]:
    """`group_size` samples for every problem, in prompt-major order.

    Prompts are split into one contiguous chunk per engine and each chunk is a single batched
    /generate call with `n = group_size`: the engine sees the same batch every run, so a fixed
    seed gives the same samples.
    """
    prompt_ids = [encode_prompt(tokenizer, problem.prompt) for problem in problems]
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    chunk = -(-len(problems) // len(clients))
    calls, starts = [], []
    for index, client in enumerate(clients):
        start = index * chunk
        batch = prompt_ids[start : start + chunk]
        if not batch:
            continue
        chunk_seed = None if seed is None else seed + start
        params = sampling_params(sampling, stop, group_size, chunk_seed)
        calls.append(client.generate(batch, params, return_logprob=True))
        starts.append(start)
    results = await asyncio.gather(*calls)
    samples: list[Sample] = []
    for start, outputs in zip(starts, results, strict=True):
        outputs = outputs if isinstance(outputs, list) else [outputs]
        for offset, output in enumerate(outputs):
            group = start + offset // group_size
            samples.append(_to_sample(group, prompt_ids[group], output, problems[group].answer))
    if len(samples) != len(problems) * group_size:
        raise ValueError(f"expected {len(problems) * group_size} samples, engines returned {len(samples)}")
    return samples
