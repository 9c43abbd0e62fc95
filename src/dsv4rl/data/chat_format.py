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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsv4rl.config.choices import ChatFormat, ReasoningEffort
from dsv4rl.config.schema import Config, DataConfig

# SGLang 0.5.23 srt/parser/deepseek_recipe_renderer.py: MODEL_NAMES["dsv4"] and IMAGE_TOKEN
RECIPE_MODEL = "DeepSeek-V4-Pro"
IMAGE_TOKEN = "<｜deepseek_image｜>"
INSTALL_HINT = (
    "data.chat_format=deepseek_v4 needs the deepseek-recipe package (DeepSeek's reference encoder): "
    "pip install deepseek-recipe (it is a dependency of dsv4rl: reinstall with `make install`)"
)


class ChatFormatError(ValueError):
    """A tokenizer or setting the chat format cannot work with; the message names the fix."""


@dataclass(frozen=True)
class ChatSettings:
    format: ChatFormat = ChatFormat.none
    thinking: bool = False
    reasoning_effort: ReasoningEffort | None = None

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether a response begins inside the thinking block (the prompt ended with <think>)."""
        return self.format == ChatFormat.deepseek_v4 and self.thinking


def data_chat_settings(data: DataConfig) -> ChatSettings:
    return ChatSettings(data.chat_format, data.thinking, data.reasoning_effort)


def eval_chat_settings(cfg: Config) -> ChatSettings:
    """The eval set's format: its own keys where set, else the recipe's data keys."""
    e, d = cfg.eval, cfg.data
    if e is None:
        return data_chat_settings(d)
    chat_format = e.chat_format if e.chat_format is not None else d.chat_format
    thinking = e.thinking if e.thinking is not None else d.thinking
    effort = e.reasoning_effort
    if effort is None and chat_format == d.chat_format and thinking == d.thinking:
        effort = d.reasoning_effort  # the training prompts' effort, where the eval asks the same way
    return ChatSettings(chat_format, thinking, effort)


def settings_problems(settings: ChatSettings, where: str) -> list[str]:
    """What is inconsistent in a format's settings (`where`: "data" or "eval"), each with its fix."""
    problems = []
    if settings.format == ChatFormat.none and settings.thinking:
        problems.append(
            f"{where}.thinking=true needs {where}.chat_format=deepseek_v4 (chat_format none has no thinking "
            "block): set the chat format or thinking=false"
        )
    if settings.reasoning_effort is not None and not settings.starts_in_reasoning:
        problems.append(
            f"{where}.reasoning_effort={settings.reasoning_effort} only applies with chat_format=deepseek_v4 "
            "and thinking=true (the encoder renders no effort otherwise): set those or reasoning_effort=null"
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


def chat_special_tokens(tokenizer: Any) -> dict[str, str]:
    """The spellings a one-turn DeepSeek-V4 chat and its response use: name -> spelling."""
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
    return {name: spelt.token(kind) for name, kind in kinds.items()}


def check_chat_tokenizer(tokenizer: Any) -> dict[str, int]:
    """name -> id of every chat special token; ChatFormatError when one is not a single token."""
    ids, missing = {}, []
    for name, spelling in chat_special_tokens(tokenizer).items():
        token_id = tokenizer.convert_tokens_to_ids(spelling)
        if token_id is None or token_id == tokenizer.unk_token_id and spelling != tokenizer.unk_token:
            missing.append(spelling)
        else:
            ids[name] = int(token_id)
    if missing:
        raise ChatFormatError(
            f"the tokenizer has no single token for {missing}: data.chat_format=deepseek_v4 needs "
            "DeepSeek-V4's special tokens (model.tokenizer=deepseek_v4, the checkpoint's own tokenizer, or "
            "the tiny model's arith_chars), or chat_format=none"
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
        if settings.format == ChatFormat.deepseek_v4:
            self.token_ids = check_chat_tokenizer(tokenizer)
            recipe = _recipe()
            special = recipe_special_tokens(tokenizer)
            self.recipe = recipe
            self.special_tokens = special
            self._options = recipe.ConversionOptions().with_special_tokens(special)
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise ChatFormatError("deepseek-recipe needs a fast tokenizer (a tokenizer.json)")
            self.recipe_tokenizer = recipe.Tokenizer.from_str(backend.to_str())
            encoding = recipe.DeepseekV4Encoding().with_special_tokens(special)
            self._encoding = encoding.with_tokenizer(self.recipe_tokenizer)

    def _conversation(self, prompt: str | list[dict[str, Any]]) -> Any:
        """As SGLang's DeepSeekRecipe.encode builds it: the request body through recipe's Chat
        Completions adapter (a problem's text is one user turn)."""
        body: dict[str, Any] = {
            "model": RECIPE_MODEL,
            "messages": user_messages(prompt) if isinstance(prompt, str) else prompt,
            "thinking": {"type": "enabled" if self.settings.thinking else "disabled"},
        }
        if self.settings.reasoning_effort is not None:
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
        return self._encoding.render_conversation(self._conversation(prompt)).prompt

    def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """A whole chat (system, user and assistant turns, as /v1/chat/completions gets it) as prompt ids;
        deepseek_v4 only (ChatFormatError otherwise)."""
        if self._encoding is None:
            raise ChatFormatError(
                "rendering a chat needs chat_format=deepseek_v4 and a tokenizer with its tokens"
            )
        return list(self._encoding.encode(self._conversation(messages)))

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each prompt's ids: chat_format none, BOS + the text's tokens (one tokenizer call for the batch);
        deepseek_v4, the encoder's ids."""
        if not prompts:
            return []
        if self._encoding is None:
            bos = self.tokenizer.bos_token_id
            encoded = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
            return [ids if bos is None or (ids and ids[0] == bos) else [bos, *ids] for ids in encoded]
        return [list(self._encoding.encode(self._conversation(prompt))) for prompt in prompts]


def _error_message(error: Any) -> str:
    body = getattr(error, "body", error)
    try:
        return json.loads(body)["error"]["message"]
    except (TypeError, ValueError, KeyError):
        return str(body)
