"""Turn a step's problems into samples: prompts -> engines' /generate -> `Sample`s with rollout log-probs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dsv4rl.config.schema import SamplingConfig
from dsv4rl.data.chat_format import PromptRenderer
from dsv4rl.data.problems import Problem
from dsv4rl.rollout.choices import ChoiceRequest, attach_choices
from dsv4rl.rollout.versions import token_versions
from dsv4rl.samples import Sample
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
    versions = token_versions(meta, len(response_ids))
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
        versions=versions,
    )


GroupHook = Callable[[int, list[Sample]], None]
# After a call to an engine failed: the engine to send it to instead (the first one is lost), or None to
# raise the error (`dsv4rl.engine_client.roster.EngineRoster.reroute`).
Reroute = Callable[[EngineAPI, BaseException], Awaitable[EngineAPI | None]]


async def generate_samples(
    clients: Sequence[EngineAPI],
    problems: Sequence[Problem],
    tokenizer,
    group_size: int,
    sampling: SamplingConfig,
    seed: int | None = None,
    renderer: PromptRenderer | None = None,
    choices: ChoiceRequest | None = None,
    on_group: GroupHook | None = None,
    requests_per_engine: int = 1,
    reroute: Reroute | None = None,
) -> list[Sample]:
    """`group_size` samples for every problem, in prompt-major order; each engine takes a contiguous chunk
    of the prompts, sent as `requests_per_engine` batched /generate calls (1: one call per engine).

    `seed=None`: each prompt is one item with `n = group_size` and no seed (SGLang then samples from its
    own state: not reproducible). With a seed (the engines run with --enable-deterministic-inference),
    every sample is its own item with `n = 1` and its own `sampling_seed` (`sample_seed`): SGLang gives
    all `n` samples of one seeded item the same seed, hence the same tokens. Prompts are sent as ids
    (`prompt_token_ids`: rendered in the recipe's chat format by `renderer`). `choices` asks the engines
    for their routing / indexer choices, kept on each sample (`dsv4rl.rollout.choices`).

    `on_group(group, samples)` is called for each prompt's samples as soon as the call that carried them
    has answered (a reward scores them while other calls are still generating); with more calls per
    engine groups come back sooner, and SGLang batches concurrent calls anyway.
    """
    asks = choices.generate_kwargs() if choices is not None else {}
    prompt_ids = prompt_token_ids(tokenizer, problems, renderer)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    chunk = -(-len(problems) // len(clients))
    calls = []
    for index, client in enumerate(clients):
        first, last = index * chunk, min((index + 1) * chunk, len(problems))
        if first >= last:
            continue
        per_call = -(-(last - first) // max(1, requests_per_engine))
        calls += [(client, start, min(start + per_call, last)) for start in range(first, last, per_call)]
    by_start: dict[int, list[Sample]] = {}

    async def run(client: EngineAPI, start: int, end: int) -> None:
        batch = prompt_ids[start:end]
        while True:
            _, call = _generate_call(client, start, batch, stop, group_size, sampling, seed, asks)
            try:
                outputs = await call
                break
            except Exception as error:
                instead = await reroute(client, error) if reroute is not None else None
                if instead is None:
                    raise
                client = instead
        outputs = outputs if isinstance(outputs, list) else [outputs]
        samples = []
        for offset, output in enumerate(outputs):
            group = start + offset // group_size
            sample = _to_sample(group, prompt_ids[group], output, problems[group].answer)
            samples.append(attach_choices(sample, output["meta_info"], choices))
        by_start[start] = samples
        if on_group is not None:
            for at in range(0, len(samples), group_size):
                on_group(start + at // group_size, samples[at : at + group_size])

    await asyncio.gather(*(run(client, start, end) for client, start, end in calls))
    samples = [sample for start in sorted(by_start) for sample in by_start[start]]
    if len(samples) != len(problems) * group_size:
        raise ValueError(f"expected {len(problems) * group_size} samples, engines returned {len(samples)}")
    return samples


def _generate_call(
    client: EngineAPI,
    start: int,
    batch: list[list[int]],
    stop: list[int],
    group_size: int,
    sampling: SamplingConfig,
    seed: int | None,
    asks: dict,
) -> tuple[int, Awaitable[Any]]:
    """(first prompt index, the /generate call) for the prompts `batch`, which start at `start`."""
    if seed is None:
        params = sampling_params(sampling, stop, group_size, None)
        return start, client.generate(batch, params, return_logprob=True, **asks)
    inputs = [ids for ids in batch for _ in range(group_size)]
    per_sample = [
        sampling_params(sampling, stop, 1, sample_seed(seed, start + prompt, sample))
        for prompt in range(len(batch))
        for sample in range(group_size)
    ]
    return start, client.generate(inputs, per_sample, return_logprob=True, **asks)
