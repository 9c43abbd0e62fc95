"""The reference run's prompt, byte for byte (docs/reference_run.md): Miles rendered DAPO-Math-17K's user
message with DeepSeek-V4's release encoder, thinking on, reasoning_effort "high", which in that encoder
writes no effort line. dapo_math asks deepseek-recipe 0.2.0 for `low`, its tier without a line."""

from __future__ import annotations

from dataset_files import DATA, needs_data
from dsv4rl.config.compose import compose
from dsv4rl.data.chat_format import PromptRenderer, data_chat_settings
from dsv4rl.data.datasets import problem_source
from dsv4rl.data.prompt_report import effort_line
from dsv4rl.model.tokenizer import run_tokenizer

# BOS, the user turn, the assistant turn opened in thinking mode: encoding_dsv4's one-turn prompt
REFERENCE = "<｜begin▁of▁sentence｜><｜User｜>{message}<｜Assistant｜><think>"


@needs_data
def test_the_first_dapo_prompt_is_the_reference_prompt_byte_for_byte():
    cfg = compose("dapo_math", [f"data.path={DATA / 'dapo_math_17k.parquet'}"])
    renderer = PromptRenderer(run_tokenizer(cfg.model), data_chat_settings(cfg.data))
    first = problem_source(cfg.data, cfg.seed)[0]
    assert first.prompt.startswith("Solve the following math problem step by step.")
    text = renderer.render(first.prompt)
    assert text.encode() == REFERENCE.format(message=first.prompt).encode()
    assert effort_line(text) is None
    # the tier deepseek-recipe 0.2.0 names `high` writes the paragraph the reference never had
    high = PromptRenderer(run_tokenizer(cfg.model), data_chat_settings(compose("dapo_math", [
        f"data.path={DATA / 'dapo_math_17k.parquet'}", "data.reasoning_effort=high"]).data))  # fmt: skip
    assert effort_line(high.render(first.prompt)) == "Reasoning Effort: Absolute maximum with no ..."


def test_the_effort_line_is_read_from_the_rendered_prompt():
    assert effort_line("<｜User｜>hi") is None
    assert effort_line("x\nReasoning Effort: Beyond maximum — exhaustive, relentless.\n") == (
        "Reasoning Effort: Beyond maximum — exhaustive, ..."
    )
