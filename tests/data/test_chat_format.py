"""DeepSeek-V4's chat format as dsv4rl renders it: deepseek-recipe's own encoding (ids, not only text), on
the packaged DeepSeek-V4 tokenizer and on the tiny character tokenizer, thinking on and off, and the
prompts max_prompt_len leaves out."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import deepseek_recipe
import pytest

from dataset_files import DATA, needs_data
from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import ChatFormat, ReasoningEffort
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import DataConfig
from dsv4rl.data.chat_format import ChatFormatError, ChatSettings, PromptRenderer, check_chat_tokenizer
from dsv4rl.data.datasets import DAPO_TEMPLATE, load_problems
from dsv4rl.data.stream import build_prompt_stream, encode_problems
from dsv4rl.model.tokenizer import build_char_tokenizer, deepseek_v4_tokenizer
from dsv4rl.model.tokenizer_files import CHAT_TOKENS, deepseek_v4_tokenizer_dir

BOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
THINKING = ChatSettings(ChatFormat.deepseek_v4, thinking=True)
ANSWERING = ChatSettings(ChatFormat.deepseek_v4, thinking=False)


@pytest.fixture(scope="module")
def dsv4():
    return deepseek_v4_tokenizer()


@functools.cache
def _recipe_encoding():
    special = deepseek_recipe.SpecialTokens(image="<｜deepseek_image｜>")
    tokenizer = deepseek_recipe.Tokenizer.from_file(str(deepseek_v4_tokenizer_dir() / "tokenizer.json"))
    return special, deepseek_recipe.DeepseekV4Encoding().with_special_tokens(special).with_tokenizer(
        tokenizer
    )


def recipe_encode(prompt: str, thinking: bool, effort: str | None = None) -> tuple[str, list[int]]:
    """deepseek-recipe on its own, as SGLang 0.5.23's DeepSeekRecipe drives it, with the packaged
    tokenizer.json: the reference dsv4rl's prompts must equal."""
    special, encoding = _recipe_encoding()
    body = {
        "model": "DeepSeek-V4-Pro",
        "messages": [{"role": "user", "content": prompt}],
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if effort is not None:
        body["reasoning_effort"] = effort
    options = deepseek_recipe.ConversionOptions().with_special_tokens(special)
    conversation = deepseek_recipe.ChatCompletionRequest(body).convert(options).conversation
    return encoding.render_conversation(conversation).prompt, encoding.encode(conversation)


def test_the_packaged_tokenizer_has_every_special_token_as_one_id(dsv4) -> None:
    assert (dsv4.bos_token, dsv4.bos_token_id, dsv4.eos_token_id, dsv4.pad_token_id) == (BOS, 0, 1, 1)
    assert len(dsv4) == 129_280  # the model's vocab_size
    ids = check_chat_tokenizer(dsv4)
    assert ids == {"bos": 0, "eos": 1, "user": 128803, "assistant": 128804, "thinking_start": 128821,
                   "thinking_end": 128822}  # fmt: skip
    for token in [BOS, *CHAT_TOKENS]:
        assert dsv4(token, add_special_tokens=False)["input_ids"] == [dsv4.convert_tokens_to_ids(token)]


@needs_data
def test_dapo_and_aime_prompts_equal_deepseek_recipe_ids(dsv4) -> None:
    dapo = load_problems("dapo_math", DATA / "dapo_math_17k_sample300.jsonl")[:25]
    aime = load_problems("aime24", DATA / "aime24.jsonl", template=DAPO_TEMPLATE)
    renderer = PromptRenderer(dsv4, THINKING)
    for problems in (dapo, aime):
        ours = renderer.encode([p.prompt for p in problems])
        for problem, ids in zip(problems, ours, strict=True):
            text, reference = recipe_encode(problem.prompt, thinking=True)
            assert ids == reference, problem.id
            assert renderer.render(problem.prompt) == text
            assert text.startswith(BOS) and USER in text and text.endswith(f"{ASSISTANT}<think>")
            # the rendered text, tokenized by the packaged tokenizer, gives the same ids
            assert dsv4(text, add_special_tokens=False)["input_ids"] == ids


def test_thinking_on_and_off_and_the_effort_preamble(dsv4) -> None:
    prompt = "What is 2+3?"
    off = PromptRenderer(dsv4, ANSWERING)
    assert off.render(prompt) == f"{BOS}{USER}{prompt}{ASSISTANT}</think>"
    assert off.encode([prompt])[0] == recipe_encode(prompt, thinking=False)[1]
    on = PromptRenderer(dsv4, THINKING).render(prompt)
    assert on.startswith(f"{BOS}Reasoning Effort: ") and on.endswith(f"{USER}{prompt}{ASSISTANT}<think>")
    low = PromptRenderer(dsv4, ChatSettings(ChatFormat.deepseek_v4, True, ReasoningEffort.low))
    assert low.render(prompt) == f"{BOS}{USER}{prompt}{ASSISTANT}<think>"
    top = PromptRenderer(dsv4, ChatSettings(ChatFormat.deepseek_v4, True, ReasoningEffort.max))
    assert top.encode([prompt])[0] == recipe_encode(prompt, True, "max")[1] != low.encode([prompt])[0]


def test_chat_format_none_is_bos_and_the_text(dsv4) -> None:
    none = PromptRenderer(dsv4, ChatSettings())
    assert none.encode(["2+3="])[0] == [0, *dsv4("2+3=", add_special_tokens=False)["input_ids"]]
    assert none.render("2+3=") == f"{BOS}2+3="


def test_the_tiny_tokenizer_carries_the_chat_tokens() -> None:
    tiny = build_char_tokenizer()
    assert [tiny.convert_tokens_to_ids(t) for t in CHAT_TOKENS] == [27, 28, 29, 30]
    renderer = PromptRenderer(tiny, ANSWERING)
    assert renderer.render("2+3=") == f"<bos>{USER}2+3={ASSISTANT}</think>"
    assert renderer.encode(["2+3="]) == [[0, 27, 6, 14, 7, 18, 28, 30]]
    assert PromptRenderer(tiny, THINKING).encode(["2+3="])[0][-1] == 29  # <think>


def test_a_tokenizer_without_chat_tokens_is_refused() -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={"<bos>": 0, "<eos>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    plain = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    with pytest.raises(ChatFormatError, match=r"no single token for \['<｜User｜>'"):
        PromptRenderer(plain, ANSWERING)
    assert PromptRenderer(plain, ChatSettings()).encode(["a"]) == [[0, 3]]  # chat_format none needs none


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    rows = [
        {"prompt": [{"role": "user", "content": p}], "reward_model": {"ground_truth": "1"}} for p in prompts
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_max_prompt_len_counts_rendered_tokens_and_drops_longer_prompts(tmp_path: Path) -> None:
    tiny = build_char_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", ["1+1=", "1+1+1+1+1+1=", "2+2="])
    cfg = compose("tiny_arith", [f"data.path={path}", "data.name=custom", "data.chat_format=deepseek_v4",
                                 "algo.prompts_per_step=2"])  # fmt: skip
    problems = build_prompt_stream(cfg).problems  # no renderer: nothing encoded, nothing dropped
    assert len(problems) == 3 and problems[0].prompt_ids is None
    renderer = PromptRenderer(tiny, ANSWERING)
    # "<bos><｜User｜>1+1=<｜Assistant｜></think>" is 8 tokens: 4 characters and 4 chat tokens
    encoded = encode_problems(problems, renderer, max_prompt_len=8)
    assert (encoded.lengths, encoded.dropped) == ([8, 16, 8], 1)
    assert [p.prompt for p in encoded.kept] == ["1+1=", "2+2="]
    assert encoded.kept[0].prompt_ids == (0, 27, 5, 14, 5, 18, 28, 30)
    for length, kept in ((8, 2), (16, 3)):
        cfg = compose("tiny_arith", [*_overrides(path), f"data.max_prompt_len={length}"])
        stream = build_prompt_stream(cfg, renderer)
        assert len(stream.problems) == kept
        assert all(p.prompt_ids is not None for p in stream.next_batch())
    with pytest.raises(ValueError, match="longer than data.max_prompt_len=7"):
        build_prompt_stream(compose("tiny_arith", [*_overrides(path), "data.max_prompt_len=7"]), renderer)


def _overrides(path: Path) -> list[str]:
    return [
        f"data.path={path}",
        "data.name=custom",
        "data.chat_format=deepseek_v4",
        "algo.prompts_per_step=2",
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.thinking=true"], "data.thinking=true needs data.chat_format=deepseek_v4"),
        (["data.chat_format=deepseek_v4", "data.reasoning_effort=low"], "data.reasoning_effort=low only"),
        (["eval.chat_format=none", "eval.thinking=true"], "eval.thinking=true needs eval.chat_format"),
    ],
)
def test_inconsistent_chat_settings_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(compose("tiny_arith", overrides), check_paths=False)


def test_the_recipes_chat_formats() -> None:
    dapo = compose("dapo_math", [])
    assert (dapo.data.chat_format, dapo.data.thinking, dapo.model.tokenizer) == (
        "deepseek_v4",
        True,
        "deepseek_v4",
    )
    assert dapo.eval.chat_format == ChatFormat.deepseek_v4 and dapo.eval.thinking
    tiny = compose("tiny_arith", [])
    assert (tiny.data.chat_format, tiny.data.thinking) == (ChatFormat.none, False)
    for name in ("aime24", "math500"):
        e = compose("tiny_arith", [f"eval={name}"]).eval
        assert (e.chat_format, e.thinking) == (ChatFormat.deepseek_v4, True)
    assert DataConfig().chat_format == ChatFormat.none
