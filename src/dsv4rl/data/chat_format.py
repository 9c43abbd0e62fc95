"""The prompt the model sees: a problem rendered in the recipe's chat format and tokenized once.

`data.chat_format=none` sends BOS + the problem's text. `deepseek_v4` renders the problem as a one-turn
chat (`[{"role": "user", "content": <problem text>}]`: DAPO-Math's own chat list, or the eval template
applied to an AIME/MATH problem) through `deepseek-recipe`, DeepSeek's reference encoder, with the
options SGLang 0.5.23 uses for a DeepSeek-V4 chat request (`srt/parser/deepseek_recipe_renderer.py`:
model name "DeepSeek-V4-Pro", the image token spelt `<｜deepseek_image｜>`, `thinking: {"type": ...}`, a
named `reasoning_effort` passed through). The encoder's ids are the prompt: engines get them as
`input_ids` and the trainer scores the same ids, so no text is ever tokenized twice.

With thinking on the prompt ends with `<｜Assistant｜><think>` (the model reasons first); off, with
`<｜Assistant｜></think>` (it answers at once). The encoder's default effort in thinking mode ("high")
adds a "Reasoning Effort: ..." preamble after BOS; `low` adds none.

`deepseek_v41` is DeepSeek-V4.1's encoding (`DeepseekV41Encoding`, model name "DeepSeek-V4.1-Flash", as
SGLang 0.5.23's renderer names it): the preamble opens a `<｜System｜>` turn and is an integer budget,
"Reasoning Effort: N (range 1-100, ...)" (low 50, high 75, max 100); `reasoning_budget` sets any N as
SGLang does for an integer `reasoning_effort`: the prompt is rendered at the `high` tier and the ids of
"Reasoning Effort: 75" are replaced by those of "Reasoning Effort: N"
(`DeepSeekRecipe._replace_effort_budget`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsv4rl.config.choices import ChatFormat, ReasoningEffort
from dsv4rl.config.schema import Config, DataConfig

# SGLang 0.5.23 srt/parser/deepseek_recipe_renderer.py: MODEL_NAMES, IMAGE_TOKEN, BUDGET_TIER and BUDGET_LINE
RECIPE_MODELS = {ChatFormat.deepseek_v4: "DeepSeek-V4-Pro", ChatFormat.deepseek_v41: "DeepSeek-V4.1-Flash"}
IMAGE_TOKEN = "<｜deepseek_image｜>"
BUDGET_TIER, BUDGET_TIER_VALUE = ReasoningEffort.high, 75  # the tier a budget is rendered at, and its budget
BUDGET_LINE = "Reasoning Effort: {budget}"
BUDGET_RANGE = (1, 100)
INSTALL_HINT = (
    "data.chat_format=deepseek_v4 (and deepseek_v41) needs the deepseek-recipe package (DeepSeek's "
    "reference encoder): pip install deepseek-recipe (it is a dependency of dsv4rl: reinstall with "
    "`make install`)"
)


class ChatFormatError(ValueError):
    """A tokenizer or setting the chat format cannot work with; the message names the fix."""


@dataclass(frozen=True)
class ChatSettings:
    format: ChatFormat = ChatFormat.none
    thinking: bool = False
    reasoning_effort: ReasoningEffort | None = None
    reasoning_budget: int | None = None  # deepseek_v41: the effort line's integer budget

    @property
    def is_chat(self) -> bool:
        """Whether prompts are rendered by deepseek-recipe (any DeepSeek chat format)."""
        return self.format != ChatFormat.none

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether a response begins inside the thinking block (the prompt ended with <think>)."""
        return self.is_chat and self.thinking


def data_chat_settings(data: DataConfig) -> ChatSettings:
    return ChatSettings(data.chat_format, data.thinking, data.reasoning_effort, data.reasoning_budget)


def eval_chat_settings(cfg: Config) -> ChatSettings:
    """The eval set's format: its own keys where set, else the recipe's data keys."""
    e, d = cfg.eval, cfg.data
    if e is None:
        return data_chat_settings(d)
    chat_format = e.chat_format if e.chat_format is not None else d.chat_format
    thinking = e.thinking if e.thinking is not None else d.thinking
    effort, budget = e.reasoning_effort, e.reasoning_budget
    if effort is None and budget is None and chat_format == d.chat_format and thinking == d.thinking:
        # the training prompts' effort, where the eval asks the same way
        effort, budget = d.reasoning_effort, d.reasoning_budget
    return ChatSettings(chat_format, thinking, effort, budget)


def settings_problems(settings: ChatSettings, where: str) -> list[str]:
    """What is inconsistent in a format's settings (`where`: "data" or "eval"), each with its fix."""
    problems = []
    if settings.format == ChatFormat.none and settings.thinking:
        problems.append(
            f"{where}.thinking=true needs {where}.chat_format=deepseek_v4 or deepseek_v41 (chat_format none "
            "has no thinking block): set the chat format or thinking=false"
        )
    if settings.reasoning_effort is not None and not settings.starts_in_reasoning:
        problems.append(
            f"{where}.reasoning_effort={settings.reasoning_effort} only applies with a DeepSeek chat format "
            "and thinking=true (the encoder renders no effort otherwise): set those or reasoning_effort=null"
        )
    budget = settings.reasoning_budget
    if budget is not None:
        low, high = BUDGET_RANGE
        if settings.format != ChatFormat.deepseek_v41 or not settings.thinking:
            problems.append(
                f"{where}.reasoning_budget={budget} only applies with chat_format=deepseek_v41 and "
                "thinking=true (DeepSeek-V4 has named tiers only: reasoning_effort): set those or "
                "reasoning_budget=null"
            )
        elif isinstance(budget, bool) or not low <= budget <= high:
            problems.append(
                f"{where}.reasoning_budget={budget} is outside DeepSeek-V4.1's budget range {low}-{high}: "
                f"set an integer from {low} to {high}"
            )
        if settings.reasoning_effort is not None:
            problems.append(
                f"{where}.reasoning_effort={settings.reasoning_effort} and reasoning_budget={budget} both "
                "set the effort line: keep one, set the other to null"
            )
    return problems


def _recipe() -> Any:
    try:
        import deepseek_recipe
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return deepseek_recipe


def recipe_special_tokens(tokenizer: Any) -> Any:
    """deepseek-recipe's special-token spellings for `tokenizer`: its own BOS and EOS (the tiny character
    tokenizer spells them <bos>/<eos>), SGLang's image token, the encoder's defaults for the rest."""
    recipe = _recipe()
    return recipe.SpecialTokens(bos=tokenizer.bos_token, eos=tokenizer.eos_token, image=IMAGE_TOKEN)


def chat_special_tokens(tokenizer: Any, chat_format: ChatFormat = ChatFormat.deepseek_v4) -> dict[str, str]:
    """The spellings a one-turn chat of `chat_format` and its response use: name -> spelling (DeepSeek-V4.1
    adds its system turn's token)."""
    recipe = _recipe()
    spelt = recipe_special_tokens(tokenizer)
    kinds = {
        "bos": recipe.SpecialToken.Bos,
        "eos": recipe.SpecialToken.Eos,
        "user": recipe.SpecialToken.User,
        "assistant": recipe.SpecialToken.Assistant,
        "thinking_start": recipe.SpecialToken.ThinkingStart,
        "thinking_end": recipe.SpecialToken.ThinkingEnd,
    }
    if chat_format == ChatFormat.deepseek_v41:
        kinds["system"] = recipe.SpecialToken.System
    return {name: spelt.token(kind) for name, kind in kinds.items()}


def check_chat_tokenizer(tokenizer: Any, chat_format: ChatFormat = ChatFormat.deepseek_v4) -> dict[str, int]:
    """name -> id of every chat special token; ChatFormatError when one is not a single token."""
    ids, missing = {}, []
    for name, spelling in chat_special_tokens(tokenizer, chat_format).items():
        token_id = tokenizer.convert_tokens_to_ids(spelling)
        if token_id is None or token_id == tokenizer.unk_token_id and spelling != tokenizer.unk_token:
            missing.append(spelling)
        else:
            ids[name] = int(token_id)
    if missing:
        sources = {
            ChatFormat.deepseek_v4: "DeepSeek-V4's special tokens (model.tokenizer=deepseek_v4, the "
            "checkpoint's own tokenizer, or the tiny model's arith_chars)",
            ChatFormat.deepseek_v41: "DeepSeek-V4.1's special tokens, <｜System｜> among them (the "
            "checkpoint's own tokenizer: the packaged deepseek_v4 one has no <｜System｜>; or the tiny "
            "model's arith_chars_v41)",
        }
        raise ChatFormatError(
            f"the tokenizer has no single token for {missing}: data.chat_format={chat_format} needs "
            f"{sources[chat_format]}, or chat_format=none"
        )
    return ids


def user_messages(prompt: str) -> list[dict[str, str]]:
    """The chat a problem is asked as: one user turn holding its text."""
    return [{"role": "user", "content": prompt}]


class PromptRenderer:
    """Problems -> the prompt ids the engines and the trainer see (and the text, for `dsv4rl prompts`)."""

    def __init__(self, tokenizer: Any, settings: ChatSettings, tools: Sequence[dict[str, Any]] = ()):
        self.tokenizer = tokenizer
        self.settings = settings
        # function schemas ({"name", "description", "parameters"}) rendered into every prompt's tool block
        self.tools = [dict(schema) for schema in tools]
        self._encoding = None
        if settings.is_chat:
            self.token_ids = check_chat_tokenizer(tokenizer, settings.format)
            recipe = _recipe()
            special = recipe_special_tokens(tokenizer)
            self.recipe = recipe
            self.special_tokens = special
            self.model_name = RECIPE_MODELS[settings.format]
            v41 = settings.format == ChatFormat.deepseek_v41
            self.model_version = (
                recipe.ModelVersion.DeepseekV41Flash if v41 else recipe.ModelVersion.DeepseekV4Pro
            )
            self._options = recipe.ConversionOptions().with_special_tokens(special)
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise ChatFormatError("deepseek-recipe needs a fast tokenizer (a tokenizer.json)")
            self._budget_ids = None  # (the tier line's ids, the budget line's ids), encoded once
            if settings.reasoning_budget is not None:
                self._budget_ids = tuple(
                    backend.encode(BUDGET_LINE.format(budget=b), add_special_tokens=False).ids
                    for b in (BUDGET_TIER_VALUE, settings.reasoning_budget)
                )
            self.recipe_tokenizer = recipe.Tokenizer.from_str(backend.to_str())
            encoding = recipe.DeepseekV41Encoding() if v41 else recipe.DeepseekV4Encoding()
            self._encoding = encoding.with_special_tokens(special).with_tokenizer(self.recipe_tokenizer)

    def _conversation(self, prompt: str | list[dict[str, Any]]) -> Any:
        """As SGLang's DeepSeekRecipe.encode builds it: the request body through recipe's Chat
        Completions adapter (a problem's text is one user turn)."""
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": user_messages(prompt) if isinstance(prompt, str) else prompt,
            "thinking": {"type": "enabled" if self.settings.thinking else "disabled"},
        }
        if self.settings.reasoning_budget is not None:
            body["reasoning_effort"] = BUDGET_TIER.value  # its line is replaced by the budget's
        elif self.settings.reasoning_effort is not None:
            body["reasoning_effort"] = self.settings.reasoning_effort.value
        if self.tools:
            body["tools"] = [{"type": "function", "function": schema} for schema in self.tools]
        try:
            return self.recipe.ChatCompletionRequest(body).convert(self._options).conversation
        except self.recipe.ConversionError as error:
            raise ChatFormatError(f"deepseek-recipe refused the prompt: {_error_message(error)}") from None

    def render(self, prompt: str) -> str:
        """The prompt as text (special tokens spelt out)."""
        if self._encoding is None:
            bos = self.tokenizer.bos_token or ""
            return prompt if prompt.startswith(bos) else bos + prompt
        text = self._encoding.render_conversation(self._conversation(prompt)).prompt
        if self.settings.reasoning_budget is None or not self.settings.thinking:
            return text
        tier, budget = (
            BUDGET_LINE.format(budget=b) for b in (BUDGET_TIER_VALUE, self.settings.reasoning_budget)
        )
        if tier not in text:
            raise ChatFormatError("deepseek-recipe rendered no reasoning effort line to put the budget in")
        return text.replace(tier, budget, 1)

    def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """A whole chat (system, user and assistant turns, as /v1/chat/completions gets it) as prompt ids;
        a DeepSeek chat format only (ChatFormatError otherwise)."""
        if self._encoding is None:
            raise ChatFormatError(
                "rendering a chat needs chat_format=deepseek_v4 or deepseek_v41 and a tokenizer with its "
                "tokens"
            )
        return self._encode(self._conversation(messages))

    def _encode(self, conversation: Any) -> list[int]:
        ids = list(self._encoding.encode(conversation))
        if self._budget_ids is None or not self.settings.thinking:
            return ids
        return self._with_budget(ids)

    def _with_budget(self, ids: list[int]) -> list[int]:
        """SGLang's `_replace_effort_budget`: the first run of the tier line's ids becomes the budget's (the
        effort line opens the prompt)."""
        tier, line = self._budget_ids
        for start in range(len(ids) - len(tier) + 1):
            if ids[start : start + len(tier)] == tier:
                return ids[:start] + line + ids[start + len(tier) :]
        raise ChatFormatError("deepseek-recipe rendered no reasoning effort line to put the budget in")

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each prompt's ids: chat_format none, BOS + the text's tokens (one tokenizer call for the batch);
        a DeepSeek chat format, the encoder's ids."""
        if not prompts:
            return []
        if self._encoding is None:
            bos = self.tokenizer.bos_token_id
            encoded = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
            return [ids if bos is None or (ids and ids[0] == bos) else [bos, *ids] for ids in encoded]
        return [self._encode(self._conversation(prompt)) for prompt in prompts]


def _error_message(error: Any) -> str:
    body = getattr(error, "body", error)
    try:
        return json.loads(body)["error"]["message"]
    except (TypeError, ValueError, KeyError):
        return str(body)
