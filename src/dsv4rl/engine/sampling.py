"""Per-sequence sampling for the reference engine (temperature, top-k/p, min-p, penalties, bias).

Logprob convention (INTERFACES.md): the reported logprob is log_softmax(logits / temperature) of the
sampled token, after penalties and bias but before top-k/top-p/min-p filtering. Temperature below 1e-6
means greedy, and the logprob then comes from the unscaled logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-6
TOP_K_ALL = 1 << 30


@dataclass
class SamplingParams:
    """The sampling_params of one sequence, already validated by the server."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def needs_logit_edits(self) -> bool:
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_new_tokens
        )


def edit_logits(
    logits: torch.Tensor, params: SamplingParams, output_ids: Sequence[int], stop_ids: Sequence[int]
) -> None:
    """Penalties, logit bias and the min_new_tokens ban on stop ids, in place on one row [V]."""
    vocab = logits.shape[-1]
    if output_ids and (
        params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0
    ):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab]
        seen = counts > 0
        if params.repetition_penalty != 1.0:
            penalised = torch.where(
                logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
            )
            logits.copy_(torch.where(seen, penalised, logits))
        logits -= params.frequency_penalty * counts.to(logits.dtype)
        logits -= params.presence_penalty * seen.to(logits.dtype)
    for token, bias in params.logit_bias.items():
        if 0 <= token < vocab:
            logits[token] += bias
    if len(output_ids) < params.min_new_tokens:
        for token in stop_ids:
            if 0 <= token < vocab:
                logits[token] = float("-inf")


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V] (fp32); returns (token ids [B], logprobs [B]).

    Each row draws one uniform from its own generator (only when not greedy), so a sequence's draws
    do not depend on which other sequences share its batch.
    """
    batch, vocab = logits.shape
    greedy = torch.tensor([p.greedy for p in params])
    temperature = torch.tensor(
        [1.0 if p.temperature < GREEDY_EPS else p.temperature for p in params], dtype=logits.dtype
    )
    logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)
    greedy_tokens = logits.argmax(dim=-1)
    if bool(greedy.all()):
        tokens = greedy_tokens
    else:
        top_k = torch.tensor([min(p.top_k, vocab) for p in params])
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)
        probs = logprobs.exp()
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab)[None, :]
        drop = ranks >= top_k[:, None]
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
        drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        drop[:, 0] = False
        kept = sorted_probs.masked_fill(drop, 0.0)
        uniforms = torch.zeros(batch, dtype=logits.dtype)
        for row, (param, generator) in enumerate(zip(params, generators, strict=True)):
            if not param.greedy:
                uniforms[row] = torch.rand((), generator=generator, dtype=torch.float64).item()
        cdf = kept.cumsum(dim=-1)
        threshold = uniforms[:, None] * cdf[:, -1:]
        pick = (cdf <= threshold).sum(dim=-1).clamp(max=vocab - 1)
        # Never pick a dropped slot (possible only through float rounding at the top of the cdf).
        last_kept = (~drop).sum(dim=-1) - 1
        pick = torch.minimum(pick, last_kept)
        sampled = order.gather(1, pick[:, None]).squeeze(1)
        tokens = torch.where(greedy, greedy_tokens, sampled)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen
