"""Turn a step's problems into samples: prompts -> engines' /generate -> `Sample`s with rollout log-probs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dsv4rl.config.schema import SamplingConfig
from dsv4rl.data.chat_format import PromptRenderer
from dsv4rl.data.problems import Problem
from dsv4rl.rollout.choices import ChoiceRequest, attach_choices
from dsv4rl.rollout.types import Sample
from dsv4rl.wire.engine_api import EngineAPI
from dsv4rl.wire.seed import mix_seed


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


def rollout_seed(seed: int, step: int, attempt: int = 0) -> int:
    """The seed of a step's rollouts (engine.reproducible_sampling): a resumed run samples what the
    uninterrupted run sampled."""
    return (seed * 1_000_003 + step * 7_919 + attempt * 104_729) % (2**31 - 1)


def sample_seed(step_seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample, from the step's seed and the sample's place in the batch (not from which
    engine serves it): the same samples whatever the number of engines. Below 2^31, valid everywhere."""
    return mix_seed(step_seed, prompt_index, sample_index) % (2**31 - 1)


def encode_prompts(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt's token ids with the model's BOS first, as DeepSeek-V4 expects; one tokenizer call for
    the batch (half the time of one call per prompt)."""
    if not prompts:
        return []
    bos = tokenizer.bos_token_id
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return [ids if bos is None or (ids and ids[0] == bos) else [bos, *ids] for ids in encoded]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """One prompt's token ids with the model's BOS first (`encode_prompts`)."""
    return encode_prompts(tokenizer, [prompt])[0]


def prompt_token_ids(
    tokenizer, problems: Sequence[Problem], renderer: PromptRenderer | None = None
) -> list[list[int]]:
    """The ids each problem is sent as: its own when encoded already (`encode_problems`), else rendered
    now by `renderer` (the recipe's chat format), else BOS + its text."""
    missing = [problem.prompt for problem in problems if problem.prompt_ids is None]
    if renderer is not None:
        fresh = iter(renderer.encode(missing))
    else:
        fresh = iter(encode_prompts(tokenizer, missing))
    return [list(p.prompt_ids) if p.prompt_ids is not None else next(fresh) for p in problems]


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
    clients: Sequence[EngineAPI],
    problems: Sequence[Problem],
    tokenizer,
    group_size: int,
    sampling: SamplingConfig,
    seed: int | None = None,
    renderer: PromptRenderer | None = None,
    choices: ChoiceRequest | None = None,
) -> list[Sample]:
    """`group_size` samples for every problem, in prompt-major order; one batched /generate per engine,
    each engine taking a contiguous chunk of the prompts.

    `seed=None`: each prompt is one item with `n = group_size` and no seed (SGLang then samples from its
    own state: not reproducible). With a seed (the engines run with --enable-deterministic-inference),
    every sample is its own item with `n = 1` and its own `sampling_seed` (`sample_seed`): SGLang gives
    all `n` samples of one seeded item the same seed, hence the same tokens. Prompts are sent as ids
    (`prompt_token_ids`: rendered in the recipe's chat format by `renderer`). `choices` asks the engines
    for their routing / indexer choices, kept on each sample (`dsv4rl.rollout.choices`).
    """
    asks = choices.generate_kwargs() if choices is not None else {}
    prompt_ids = prompt_token_ids(tokenizer, problems, renderer)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    chunk = -(-len(problems) // len(clients))
    calls, starts = [], []
    for index, client in enumerate(clients):
        start = index * chunk
        batch = prompt_ids[start : start + chunk]
        if not batch:
            continue
        if seed is None:
            calls.append(
                client.generate(
                    batch, sampling_params(sampling, stop, group_size, None), return_logprob=True, **asks
                )
            )
        else:
            inputs = [ids for ids in batch for _ in range(group_size)]
            per_sample = [
                sampling_params(sampling, stop, 1, sample_seed(seed, start + prompt, sample))
                for prompt in range(len(batch))
                for sample in range(group_size)
            ]
            calls.append(client.generate(inputs, per_sample, return_logprob=True, **asks))
        starts.append(start)
    results = await asyncio.gather(*calls)
    samples: list[Sample] = []
    for start, outputs in zip(starts, results, strict=True):
        outputs = outputs if isinstance(outputs, list) else [outputs]
        for offset, output in enumerate(outputs):
            group = start + offset // group_size
            sample = _to_sample(group, prompt_ids[group], output, problems[group].answer)
            samples.append(attach_choices(sample, output["meta_info"], choices))
    if len(samples) != len(problems) * group_size:
        raise ValueError(f"expected {len(problems) * group_size} samples, engines returned {len(samples)}")
    return samples
