"""`data.chat_format=deepseek_v41`: DeepSeek-V4.1's prompts are deepseek-recipe's own `DeepseekV41Encoding`
ids (a `<｜System｜>` turn, an integer effort line), an integer `reasoning_budget` replaces the tier's line
as SGLang does, responses and V4.1's DSML calls (`<｜DSML｜ calls>`) are parsed by recipe's V4.1 parser, and
the settings and tokenizers V4.1 cannot work with are refused before a run starts. SGLang's own renderer
and detector check the same ids and calls in `test_chat_format_sglang.py`."""

from __future__ import annotations

import json

import deepseek_recipe
import pytest

from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import ChatFormat, ReasoningEffort
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.data.chat_format import ChatFormatError, ChatSettings, PromptRenderer
from dsv4rl.data.chat_response import ResponseParser
from dsv4rl.model.tokenizer import build_char_tokenizer, load_tokenizer
from dsv4rl.model.tokenizer_files import CHAT_TOKENS
from dsv4rl.rollout.turn_format import DsmlFormat
from v41_tokenizer import SYSTEM, dsv41_tokenizer, tool_call_messages

V41 = ChatFormat.deepseek_v41
PROBLEM = "What is 6*7?"
SCHEMA = {
    "name": "python",
    "description": "Run Python code and get what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}


@pytest.fixture(scope="module")
def tok():
    return dsv41_tokenizer()


def recipe_ids(tok, thinking: bool, effort: str | None = None, tools: bool = False) -> tuple[str, list[int]]:
    """deepseek-recipe's V4.1 encoding on its own, driven as SGLang 0.5.23's DeepSeekRecipe drives it."""
    special = deepseek_recipe.SpecialTokens(
        bos=tok.bos_token, eos=tok.eos_token, image="<｜deepseek_image｜>"
    )
    recipe_tok = deepseek_recipe.Tokenizer.from_str(tok.backend_tokenizer.to_str())
    encoding = deepseek_recipe.DeepseekV41Encoding().with_special_tokens(special).with_tokenizer(recipe_tok)
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": PROBLEM}],
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if effort is not None:
        body["reasoning_effort"] = effort
    if tools:
        body["tools"] = [{"type": "function", "function": SCHEMA}]
    options = deepseek_recipe.ConversionOptions().with_special_tokens(special)
    conversation = deepseek_recipe.ChatCompletionRequest(body).convert(options).conversation
    return encoding.render_conversation(conversation).prompt, list(encoding.encode(conversation))


@pytest.mark.parametrize(
    ("thinking", "effort", "line"),
    [
        (True, None, "Reasoning Effort: 75 (range 1-100"),
        (True, ReasoningEffort.low, "Reasoning Effort: 50 (range 1-100"),
        (True, ReasoningEffort.high, "Reasoning Effort: 75 (range 1-100"),
        (True, ReasoningEffort.max, "Reasoning Effort: 100 (range 1-100"),
        (False, None, None),
    ],
)
def test_prompts_are_deepseek_recipes_v41_ids(tok, thinking, effort, line) -> None:
    renderer = PromptRenderer(tok, ChatSettings(V41, thinking, effort))
    text, ids = recipe_ids(tok, thinking, effort.value if effort else None)
    assert renderer.render(PROBLEM) == text and renderer.encode([PROBLEM]) == [ids]
    system = tok.convert_tokens_to_ids(SYSTEM)
    if line is None:  # no effort line, so no system turn: V4's layout with V4.1's encoder
        assert system not in ids and text.endswith(f"{PROBLEM}<｜Assistant｜></think>")
    else:  # the effort line opens a system turn after BOS
        assert ids[:2] == [tok.bos_token_id, system] and text.split(SYSTEM, 1)[1].startswith(line)
        assert text.endswith("<｜Assistant｜><think>")
    v4 = PromptRenderer(tok, ChatSettings(ChatFormat.deepseek_v4, thinking, effort)).encode([PROBLEM])
    assert (v4 == [ids]) == (line is None)  # V4 writes its own effort text; without one the two agree


@pytest.mark.parametrize("budget", [1, 33, 75, 100])
def test_a_budget_replaces_the_high_tiers_line_as_sglang_does(tok, budget) -> None:
    renderer = PromptRenderer(tok, ChatSettings(V41, True, reasoning_budget=budget))
    text, high = recipe_ids(tok, True, "high")
    tier = tok("Reasoning Effort: 75", add_special_tokens=False)["input_ids"]
    line = tok(f"Reasoning Effort: {budget}", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(high)) if high[i : i + len(tier)] == tier)
    assert renderer.encode([PROBLEM]) == [high[:start] + line + high[start + len(tier) :]]
    assert renderer.render(PROBLEM) == text.replace("Reasoning Effort: 75", f"Reasoning Effort: {budget}", 1)
    assert f"Reasoning Effort: {budget} (range 1-100" in renderer.render(PROBLEM)


def test_v41_responses_split_at_think_end(tok) -> None:
    parser = ResponseParser(PromptRenderer(tok, ChatSettings(V41, True)))
    ids = tok("Six sevens.</think>42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    parts = parser.parse(ids, tok.decode(ids))
    assert (parts.reasoning, parts.answer) == ("Six sevens.", "42")
    cut = tok("Six sevens.", add_special_tokens=False)["input_ids"]
    assert parts.reasoning_tokens == len(cut) and parts.answer_tokens == len(ids) - 1 - len(cut) - 1
    unfinished = tok("Six sevens", add_special_tokens=False)["input_ids"]
    assert parser.parse(unfinished, "Six sevens").answer is None


def test_v41_tool_calls_are_written_and_read_in_v41s_tags(tok) -> None:
    """The tool block and an assistant call as recipe's V4.1 encoding writes them (`<｜DSML｜ calls>`, the
    leading space intended), read back by DsmlFormat through recipe's V4.1 parser."""
    renderer = PromptRenderer(tok, ChatSettings(V41, True), tools=[SCHEMA])
    fmt = DsmlFormat(renderer)
    assert renderer.encode([PROBLEM]) == [recipe_ids(tok, True, tools=True)[1]]
    messages = tool_call_messages(PROBLEM)
    prompt, rendered = fmt.encode(messages[:1]), fmt.encode(messages)  # the call turn ends at EOS
    assert rendered[: len(prompt)] == prompt
    turn_ids = rendered[len(prompt) : rendered.index(tok.eos_token_id, len(prompt)) + 1]
    text = tok.decode(turn_ids)
    assert '<｜DSML｜ calls>\n<｜DSML｜ invoke name="python">' in text and "<｜DSML｜tool_calls>" not in text
    turn = fmt.parse(turn_ids, 0, "stop")
    assert turn.parse_error is None and turn.reasoning == "Use the tool."
    assert [(c.name, json.loads(c.arguments)) for c in turn.calls] == [("python", {"code": "print(6*7)"})]


def test_the_tiny_v41_tokenizer_adds_the_system_token_after_v4s() -> None:
    v4, v41 = (
        build_char_tokenizer(),
        load_tokenizer(compose("tiny_arith", ["model.tokenizer=arith_chars_v41"]).model),
    )
    assert [v41.convert_tokens_to_ids(t) for t in CHAT_TOKENS] == [
        v4.convert_tokens_to_ids(t) for t in CHAT_TOKENS
    ]
    assert v41.convert_tokens_to_ids(SYSTEM) == len(v4) and len(v41) == len(v4) + 1
    text = PromptRenderer(v41, ChatSettings(V41, True, reasoning_budget=40)).render("2+3=")
    assert text.startswith(f"<bos>{SYSTEM}Reasoning Effort: 40 ") and text.endswith(
        "2+3=<｜Assistant｜><think>"
    )
    with pytest.raises(ChatFormatError, match=r"no single token for \['<｜System｜>'\].*arith_chars_v41"):
        PromptRenderer(v4, ChatSettings(V41, True))


V41_DATA = ["data.chat_format=deepseek_v41", "model.tokenizer=arith_chars_v41"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.chat_format=deepseek_v41"], "model.tokenizer=arith_chars has not: .*arith_chars_v41"),
        (["data.chat_format=deepseek_v41", "model.tokenizer=deepseek_v4"],
         "model.tokenizer=deepseek_v4 has not"),
        (["data.chat_format=deepseek_v4", "data.thinking=true", "data.reasoning_budget=40"],
         "data.reasoning_budget=40 only applies with chat_format=deepseek_v41"),
        ([*V41_DATA, "data.reasoning_budget=40"], "data.reasoning_budget=40 only applies"),  # thinking off
        ([*V41_DATA, "data.thinking=true", "data.reasoning_budget=101"], "outside DeepSeek-V4.1's budget"),
        ([*V41_DATA, "data.thinking=true", "data.reasoning_budget=0"], "outside DeepSeek-V4.1's budget"),
        ([*V41_DATA, "data.thinking=true", "data.reasoning_budget=60", "data.reasoning_effort=max"],
         "both set the effort line"),
        (["eval.chat_format=deepseek_v41", "eval.thinking=true", "eval.reasoning_budget=60"],
         "model.tokenizer=arith_chars has not"),
    ],
)  # fmt: skip
def test_what_v41_cannot_work_with_is_refused_before_a_run(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(compose("tiny_arith", overrides))


def test_v41_settings_that_work_validate() -> None:
    cfg = compose("tiny_arith", [*V41_DATA, "data.thinking=true", "data.reasoning_budget=60"])
    validate(cfg)
    cfg = compose("tiny_arith", [*V41_DATA, "eval.thinking=true", "eval.reasoning_budget=30"])
    validate(cfg)
