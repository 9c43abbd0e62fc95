"""The `dsv4rl align` report as tables: every number of the report is shown, none cut off."""

from __future__ import annotations

from rich.console import Console

from dsv4rl.launcher.align_view import render_align

REPORT = {
    "quant": "fp8_mxfp4", "tokens": 128, "mean_abs_diff": 0.00575, "p50_abs_diff": 0.00569,
    "p95_abs_diff": 0.0124, "p99_abs_diff": 0.0154, "max_abs_diff": 0.0154, "mean_diff": 0.00175,
    "kl_k3": 2.42e-05, "responses": 128, "prompts": 32, "samples_per_prompt": 4, "max_new_tokens": 1,
    "temperature": 1.0, "engines": ["http://127.0.0.1:30000"],
    "sync": {"bytes": 333941, "seconds": 0.39, "buckets": 2, "tensors": 252},
    "worst_tokens": [{"abs_diff": 0.0154, "trainer_logprob": -3.026, "rollout_logprob": -3.041,
                      "context": "<bos>0+0=", "token": "Q", "sequence": 0, "position": 5, "token_id": 26}],
}  # fmt: skip


def test_render_align_shows_every_number_on_a_narrow_terminal() -> None:
    console = Console(width=80, record=True)
    render_align(REPORT, console)
    text = console.export_text()
    for value in ("fp8_mxfp4", "128", "0.00575", "0.00569", "0.0124", "0.0154", "+0.00175", "2.42e-05"):
        assert value in text, value
    assert "'<bos>0+0='" in text and "-3.041" in text and "0.33 MB in 2 buckets" in text
