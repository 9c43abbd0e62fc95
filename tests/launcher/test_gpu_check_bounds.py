"""The GPU check's summary passes a push on its measurements only: align's |trainer - engine| log-prob
under the format's bounds (launch/gpu_check_summary.py `LOGPROB_BOUNDS`), never align's exit code alone.

The push checks' result files are made by align's own report writer (`dsv4rl.train.align`) from log-probs
the tiny model computes: the trainer's weights against an engine's that got them in bf16, honestly or with a
wrong push (the lm_head shifted by one row, as a wrong offset would leave it; a bucket's bytes flipped).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_launch_scripts import conforms, gpu_check_summary_module

from dsv4rl.algo.grpo import token_logprobs
from dsv4rl.config.choices import QuantMode, SyncTransport
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import Config
from dsv4rl.model.native_checkpoint import load_native_model, write_native_checkpoint
from dsv4rl.model.tiny import build_tiny_model
from dsv4rl.model.tokenizer import load_tokenizer
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.samples import Sample
from dsv4rl.sync.weight_sync import SyncStats
from dsv4rl.train.align import align_report, write_report
from dsv4rl.train.batch import TrainBatch

PROMPT, RESPONSE, SEQUENCES = 4, 8, 16
PUSH = "colocated_push.bf16"


def wrong_head(engine: torch.nn.Module) -> None:
    head = engine.lm_head.weight
    head.copy_(head.roll(1, 0))


def flipped_head(engine: torch.nn.Module) -> None:
    head = engine.lm_head.weight
    head.copy_((head.detach().contiguous().view(torch.uint8) ^ 0x5A).view(head.dtype))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The trainer's tiny model, its tokenizer, and token sequences an engine sampled."""
    tokenizer = load_tokenizer(ModelConfig())
    trainer = build_tiny_model(ModelConfig(), len(tokenizer)).eval()
    ids = torch.randint(
        4, len(tokenizer), (SEQUENCES, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(0)
    )
    return trainer, tokenizer, ids, tmp_path_factory.mktemp("engine")


@torch.no_grad()
def align_json(tiny, out: Path, name: str, break_push=None) -> dict:
    """`<out>/<name>.json` and `.rc` as gpu_check.sh leaves them: align's report, written by align's writer,
    of the trainer against an engine holding its weights pushed in bf16 (then `break_push`ed)."""
    trainer, tokenizer, ids, folder = tiny
    write_native_checkpoint(trainer, folder, WireFormat("bf16"))  # what an honest bf16 push leaves
    engine = load_native_model(folder).eval()
    if break_push is not None:
        break_push(engine)
    engine_logprobs = token_logprobs(engine(input_ids=ids, use_cache=False).logits, ids)
    samples = [
        Sample(row, ids[row, :PROMPT].tolist(), ids[row, PROMPT:].tolist(),
               engine_logprobs[row, PROMPT - 1 :].tolist(), "", "length")
        for row in range(SEQUENCES)
    ]  # fmt: skip
    batch = TrainBatch.from_samples(samples, pad_id=tokenizer.pad_token_id)
    cfg = Config()
    cfg.quant.name = QuantMode.bf16
    stats = SyncStats(bytes=600_000, seconds=0.05, buckets=1, tensors=155, transport=SyncTransport.tensor)
    trainer_logprobs = token_logprobs(
        trainer(input_ids=batch.input_ids, use_cache=False).logits, batch.input_ids
    )
    report = align_report(cfg, batch, trainer_logprobs, stats, ["http://127.0.0.1:30000"], tokenizer)
    run_dir = out / name / "align" / "bf16"
    run_dir.mkdir(parents=True)
    shutil.copy(write_report(run_dir, report), out / f"{name}.json")  # `dsv4rl align --json` prints it
    (out / f"{name}.rc").write_text("0\n")
    (out / f"{name}.log").write_text("finished\n")
    return report


def summarize(out: Path, formats: tuple[str, ...] = ("bf16",)) -> tuple[int, dict, str]:
    """The summary of `out` (one GPU, trainer passed) as gpu_check.sh runs it: exit code, JSON, text."""
    (out / "trainer").mkdir(exist_ok=True)
    checks = {key: {"ok": True} for key in gpu_check_summary_module().TRAINER_CHECKS}
    (out / "trainer" / "trainer.json").write_text(json.dumps({"ok": True, **checks}))
    (out / "trainer.rc").write_text("0\n")
    summary = gpu_check_summary_module()
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = summary.main(["summary", str(out), "--gpus", "1", "--device", "NVIDIA H100",
                             "--cluster-device", "h100", "--comm", "nccl_h100", "--shape", "tiny", "--sglang",
                             "sglang-python", "--engines", "1", "--formats", *formats])  # fmt: skip
    report = json.loads(stdout.getvalue())
    conforms(report, summary.SUMMARY_SCHEMA)
    return code, report, stderr.getvalue()


def push_entry(report: dict, name: str = PUSH) -> dict:
    return next(check for check in report["checks"] if check["name"] == name)


def test_an_honest_push_passes_with_its_figures_beside_the_bounds(tiny, tmp_path: Path) -> None:
    align = align_json(tiny, tmp_path, PUSH)
    code, report, text = summarize(tmp_path)
    entry = push_entry(report)
    bounds = gpu_check_summary_module().LOGPROB_BOUNDS["bf16"]
    assert (code, report["ok"], entry["status"], entry["error"]) == (0, True, "passed", None)
    assert entry["bounds"] == bounds
    figures = entry["figures"]
    assert (figures["logprob_mean_abs_diff"], figures["logprob_max_abs_diff"], figures["tokens"]) == (
        align["mean_abs_diff"], align["max_abs_diff"], SEQUENCES * RESPONSE,
    )  # fmt: skip
    assert 0 < figures["logprob_max_abs_diff"] < bounds["logprob_max_abs_diff"]  # bf16 rounding, measured
    line = next(line for line in text.splitlines() if PUSH in line)
    assert "passed" in line
    assert f"mean {figures['logprob_mean_abs_diff']:.4g} (bound {bounds['logprob_mean_abs_diff']:g})" in line
    assert f"max {figures['logprob_max_abs_diff']:.4g} (bound {bounds['logprob_max_abs_diff']:g})" in line


@pytest.mark.parametrize("break_push", [wrong_head, flipped_head], ids=["head-shifted", "bytes-flipped"])
def test_a_wrong_push_fails_though_align_exited_0(tiny, tmp_path: Path, break_push) -> None:
    align_json(tiny, tmp_path, PUSH, break_push)
    code, report, text = summarize(tmp_path)
    entry = push_entry(report)
    assert (code, report["ok"], entry["ok"], entry["status"], entry["exit_code"]) == (
        1,
        False,
        False,
        "failed",
        0,
    )
    assert any("logprob_mean_abs_diff" in problem and "is over its bound 0.03" in problem
               for problem in entry["error"]), entry["error"]  # fmt: skip
    assert "gpu check: FAILED" in text and f"{PUSH}  failed" in text


def test_align_exiting_0_without_the_figures_is_not_measured(tiny, tmp_path: Path) -> None:
    """No report, a report without the max, a format no bound is set for: never passed."""
    align = align_json(tiny, tmp_path, PUSH)
    (tmp_path / f"{PUSH}.json").unlink()
    code, report, _ = summarize(tmp_path)
    entry = push_entry(report)
    assert (code, report["ok"], entry["status"], entry["figures"]) == (1, False, "not measured", None)
    assert entry["error"][0] == f"dsv4rl align exited 0 but {tmp_path / (PUSH + '.json')} is missing"

    del align["max_abs_diff"]
    (tmp_path / f"{PUSH}.json").write_text(json.dumps(align))
    code, report, text = summarize(tmp_path)
    entry = push_entry(report)
    assert (code, entry["status"], entry["figures"]["logprob_max_abs_diff"]) == (1, "not measured", None)
    assert entry["error"][0].startswith("logprob_max_abs_diff is not in align's report")
    assert "max missing (bound 0.5)" in text

    align_json(tiny, tmp_path, "colocated_push.fp4_someday")
    code, report, _ = summarize(tmp_path, ("bf16", "fp4_someday"))
    entry = push_entry(report, "colocated_push.fp4_someday")
    assert (code, entry["status"], entry["bounds"]) == (1, "not measured", None)
    assert "no log-prob bounds for quant=fp4_someday" in entry["error"][0]


def test_a_trainer_report_without_its_checks_is_not_measured(tiny, tmp_path: Path) -> None:
    align_json(tiny, tmp_path, PUSH)
    summarize(tmp_path)  # writes a passing trainer report; replace it with one that only says ok
    (tmp_path / "trainer" / "trainer.json").write_text(json.dumps({"ok": True}))
    summary = gpu_check_summary_module()
    entry = summary.result(tmp_path, summary.TRAINER)
    assert (entry["ok"], entry["status"]) == (False, "not measured")
    assert entry["error"][0] == "bf16_parity is not in its report"
