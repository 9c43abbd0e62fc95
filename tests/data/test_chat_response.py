"""Responses split into reasoning and answer by deepseek-recipe's parser: closed, unclosed and empty
thinking, non-thinking prompts, and chat_format none (untouched)."""

from __future__ import annotations

import pytest

from dsv4rl.config.choices import ChatFormat
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer
from dsv4rl.data.chat_response import (
    ResponseParser,
    ResponseParts,
    response_split_metrics,
    split_saved_response,
)
from dsv4rl.model.tokenizer import build_char_tokenizer, deepseek_v4_tokenizer


@pytest.fixture(scope="module")
def dsv4():
    return deepseek_v4_tokenizer()


def parser(tokenizer, thinking: bool, chat_format: ChatFormat = ChatFormat.deepseek_v4) -> ResponseParser:
    return ResponseParser(PromptRenderer(tokenizer, ChatSettings(chat_format, thinking)))


def ids(tokenizer, text: str, eos: bool = True) -> list[int]:
    out = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [*out, tokenizer.eos_token_id] if eos else out


def test_closed_thinking_splits_at_the_end_of_thinking(dsv4) -> None:
    response = ids(dsv4, "\n\nLet me add: 2+3=5.\n</think>\n\nThe sum is 5.\nAnswer: 5")
    parts = parser(dsv4, True).parse(response, "")
    assert parts.reasoning == "Let me add: 2+3=5."  # recipe drops the newlines around the reasoning
    assert parts.answer == "The sum is 5.\nAnswer: 5"  # ... and those that open the answer; no EOS
    cut = response.index(dsv4.convert_tokens_to_ids("</think>"))
    assert (parts.reasoning_tokens, parts.answer_tokens) == (cut, len(response) - cut - 2)


def test_unclosed_thinking_has_no_answer(dsv4) -> None:
    response = ids(dsv4, "Let me think. Answer: 5 maybe, but", eos=False)  # cut off by the token cap
    parts = parser(dsv4, True).parse(response, "")
    assert parts == ResponseParts("Let me think. Answer: 5 maybe, but", None, len(response), 0)


def test_empty_thinking(dsv4) -> None:
    response = ids(dsv4, "</think>Answer: 5")
    assert parser(dsv4, True).parse(response, "") == ResponseParts("", "Answer: 5", 0, len(response) - 2)


def test_an_empty_answer_is_an_answer(dsv4) -> None:
    response = ids(dsv4, "thought</think>")
    parts = parser(dsv4, True).parse(response, "")
    assert (parts.reasoning, parts.answer, parts.answer_tokens) == ("thought", "", 0)


def test_without_thinking_the_whole_response_is_the_answer(dsv4) -> None:
    response = ids(dsv4, "Answer: 5")
    assert parser(dsv4, False).parse(response, "") == ResponseParts("", "Answer: 5", 0, len(response) - 1)


def test_chat_format_none_leaves_the_response_as_the_engine_returned_it(dsv4) -> None:
    response = ids(dsv4, "x</think>Answer: 5")
    parts = parser(dsv4, False, ChatFormat.none).parse(response, "engine text")
    assert parts == ResponseParts("", "engine text", 0, len(response) - 1)


def test_the_tiny_tokenizer_parses_like_the_real_one() -> None:
    tiny = build_char_tokenizer()
    assert parser(tiny, True).parse(ids(tiny, "1+1</think>2"), "") == ResponseParts("1+1", "2", 3, 1)
    assert parser(tiny, True).parse(ids(tiny, "2", eos=False), "") == ResponseParts("2", None, 1, 0)
    assert parser(tiny, False).parse(ids(tiny, "2"), "2") == ResponseParts("", "2", 0, 1)


def test_split_metrics() -> None:
    parts = [ResponseParts("r", "a", 4, 2), ResponseParts("r", None, 10, 0)]
    assert response_split_metrics(parts) == {
        "no_answer_fraction": 0.5,
        "reasoning_len_mean": 7.0,
        "answer_len_mean": 1.0,
    }
    assert response_split_metrics(parts, "eval/")["eval/no_answer_fraction"] == 0.5


@pytest.mark.parametrize(
    "text",
    [
        "\n\nLet me add: 2+3=5.\n</think>\n\nThe sum is 5.\nAnswer: 5",
        "</think>Answer: 5",
        "<think>thought  \n</think>  Answer: 5\n",
        "Answer: 5",  # no thinking block: all answer
        "a</think>b</think>c",
    ],
)
def test_the_saved_text_rule_equals_the_package_parser(dsv4, text: str) -> None:
    """SGLang's whole-output rule (thinking unknown), on text, against recipe's parser on its tokens."""
    body = text.removeprefix("<think>")
    tokens = dsv4(body, add_special_tokens=False)["input_ids"]
    thinking = "</think>" in body
    parts = parser(dsv4, thinking).parse(tokens, body)
    assert split_saved_response(text) == (parts.reasoning, parts.answer)
