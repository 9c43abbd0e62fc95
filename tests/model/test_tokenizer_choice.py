"""model.tokenizer=deepseek_v4 loads the packaged DeepSeek-V4 tokenizer; a model directory's own tokenizer
wins, and with deepseek_v4 the two must agree on the special tokens (refused before start when not)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4rl.checks.machine import check_chat_tokenizer_files
from dsv4rl.config.compose import compose
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.model.tokenizer import (
    CHAT_TOKENS,
    build_char_tokenizer,
    deepseek_v4_tokenizer,
    load_tokenizer,
    run_tokenizer,
)
from dsv4rl.model.tokenizer_files import tokenizer_dir_problems


@pytest.fixture(scope="module")
def dsv4_dir(tmp_path_factory) -> Path:
    """A model directory with DeepSeek-V4's tokenizer files in it, as a checkpoint has them."""
    directory = tmp_path_factory.mktemp("dsv4-model")
    deepseek_v4_tokenizer().save_pretrained(directory)
    (directory / "config.json").write_text("{}")
    return directory


@pytest.fixture(scope="module")
def chars_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("chars-model")
    build_char_tokenizer().save_pretrained(directory)
    (directory / "config.json").write_text("{}")
    return directory


def test_deepseek_v4_loads_the_packaged_tokenizer() -> None:
    tokenizer = load_tokenizer(ModelConfig(tokenizer="deepseek_v4"))
    assert len(tokenizer) == 129_280 and tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 1
    assert [tokenizer.convert_tokens_to_ids(t) for t in CHAT_TOKENS] == [128803, 128804, 128821, 128822]


def test_the_model_directory_tokenizer_wins_when_it_agrees(dsv4_dir: Path, chars_dir: Path) -> None:
    own = run_tokenizer(ModelConfig(path=str(dsv4_dir), tokenizer="deepseek_v4"))
    assert own.name_or_path == str(dsv4_dir)
    # a directory with another tokenizer: taken as it is when model.tokenizer names no packaged one
    assert len(run_tokenizer(ModelConfig(path=str(chars_dir), tokenizer=str(chars_dir)))) == 31
    with pytest.raises(ValueError, match=r"disagree on special tokens: bos_token: '<bos>'"):
        run_tokenizer(ModelConfig(path=str(chars_dir), tokenizer="deepseek_v4"))


def test_a_model_directory_without_a_tokenizer_uses_model_tokenizer(tmp_path: Path) -> None:
    assert len(run_tokenizer(ModelConfig(path=str(tmp_path), tokenizer="deepseek_v4"))) == 129_280


def test_the_files_are_checked_before_any_process_starts(dsv4_dir: Path, chars_dir: Path) -> None:
    assert tokenizer_dir_problems(dsv4_dir, chat=True, against_packaged=True) == []
    assert (
        tokenizer_dir_problems(chars_dir, chat=True, against_packaged=False) == []
    )  # it has the chat tokens
    (problem,) = tokenizer_dir_problems(chars_dir, chat=True, against_packaged=True)
    assert "disagree on special token ids" in problem and "<｜begin▁of▁sentence｜>: None vs 0" in problem
    problems: list[str] = []
    cfg = compose("dapo_math", [f"model.path={chars_dir}"])
    check_chat_tokenizer_files(cfg, problems.append)
    assert len(problems) == 1 and "point model.path at a DeepSeek-V4 checkpoint" in problems[0]
    problems.clear()
    check_chat_tokenizer_files(compose("dapo_math", [f"model.path={dsv4_dir}"]), problems.append)
    assert problems == []
