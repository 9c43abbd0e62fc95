"""The reference engine's state, what every route handler works on: model, tokenizer, generator, held
weights and their memory, status, and the weight-update session.

With `--emulate-non-idempotent-postprocess` (the reference engine's own mode) the session's close behaves
as SGLang's on ROCm, where `/end_weight_update` re-shuffles in place every MoE and FP8-linear weight,
re-sent or not (`sglang/srt/layers/quantization/fp8.py:2163-2174,915-929`): the routed-expert and FP8-linear
weights the session did not re-send are laid out again, i.e. corrupted. Stricter than SGLang, the engine
then refuses to generate (`spent`), and so it does once an update fails in a session that already wrote
weights (SGLang: "partially updated ... discard the whole weights"): such an engine is never silently
served, it must be restarted.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import sys
import threading
import time
import uuid
from dataclasses import asdict
from typing import Any

import torch

from dsv4rl.engine.args import ServerArgs
from dsv4rl.engine.capture import ChoiceCapture
from dsv4rl.engine.generator import Generator, GenRequest
from dsv4rl.engine.memory import EngineMemory
from dsv4rl.engine.numerics import install_numerics
from dsv4rl.engine.sampling import SamplingParams
from dsv4rl.engine.weight_store import DeepseekWeights
from dsv4rl.model.naming import CheckpointKind, checkpoint_kind
from dsv4rl.model.native_checkpoint import (
    CheckpointError,
    block_size,
    checkpoint_format,
    is_native_checkpoint,
    load_native_checkpoint,
    read_config,
)

__all__ = ["READY_LINE", "VERSION", "Engine", "checkpoint_description"]

log = logging.getLogger("dsv4rl.engine")
VERSION = "0.5.23"
READY_LINE = "The server is fired up and ready to roll!"
RELAID_OUT = (CheckpointKind.routed_expert, CheckpointKind.fp8_linear)  # what SGLang shuffles on ROCm
RESTART = "restart the engine (`dsv4rl train ... resume=auto` starts new ones)"


def choice_capture(model: torch.nn.Module, args: ServerArgs) -> ChoiceCapture | None:
    """The routed-experts / indexer-top-k capture the launch flags ask for (none: no hooks at all)."""
    if not (args.enable_return_routed_experts or args.enable_return_indexer_topk):
        return None
    return ChoiceCapture(
        model, routed=args.enable_return_routed_experts, indexer=args.enable_return_indexer_topk
    )


class Engine:
    """Everything a request handler needs: model, tokenizer, generator, status and the weight session."""

    def __init__(self, args: ServerArgs, receiver: Any = None) -> None:
        self.args = args
        if args.random_seed is None:
            args.random_seed = random.randint(0, 2**30)
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        # The forward runs in float32 on the dequantized weights ("auto"), or in the dtype asked for.
        dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
        self.model, stored = load_native_checkpoint(args.model_path, dtype)
        self.weights = DeepseekWeights(self.model, stored, *checkpoint_description(args.model_path))
        self.numerics = install_numerics(args, self.weights)  # SGLang's rounding points (--numerics sglang)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.context_length = args.context_length or self.model.config.max_position_embeddings
        self.generator = Generator(
            self.model,
            max_batch_size=args.max_batch_size,
            random_seed=args.random_seed,
            weight_version=args.weight_version,
            context_length=self.context_length,
            decode_text=self.decode if self.tokenizer is not None else None,
            deterministic=args.enable_deterministic_inference,
            capture=choice_capture(self.model, args),
        )
        self.memory = EngineMemory(self.weights, self.generator, memory_saver=args.enable_memory_saver)
        self.generator.admission = self.refusal  # nothing runs on released memory or spent weights
        self.status = "Starting"
        self.shutting_down = False
        self.session_open = False
        self.session_sent: set[str] = set()  # tensors written in the open session
        self.sessions = 0  # sessions opened
        self._session_step = 0  # an update's heartbeat step (`session_step`)
        self.spent: str | None = None  # why the weights must not be served (emulated post-processing)
        self.receiver = receiver
        self.startup_time = time.time()
        self.checksum_snapshot: dict[str, str] | None = None
        self.ready = threading.Event()

    def refusal(self) -> str | None:
        """Why no request may run now: spent weights, or released memory; None when one may."""
        return self.spent or self.memory.refusal()

    # ------------------------------------------------------------------------------------------ session
    def open_session(self) -> None:
        held = self.generator.weight_version
        self.session_open, self.session_sent = True, set()
        # the trainer's step whose weights this session brings: one past the version held (its versions
        # are its steps), 0 for the engine's first push; else the session's number from 0
        self._session_step = int(held) + 1 if self.sessions and held.isdigit() else self.sessions
        self.sessions += 1

    @property
    def session_step(self) -> int | None:
        """The open (or last) session's step: 0 for the push at start, then the trainer's step whose
        weights it brings, in a resumed run and on a restarted engine too (which count from 0 at their
        first push). None before any session."""
        return self._session_step if self.sessions else None

    def update_failed(self, error: str) -> None:
        """An update request failed inside the open session. Emulating SGLang's non-idempotent path, a
        session that already wrote weights leaves them partly updated: the engine is spent."""
        if self.args.emulate_non_idempotent_postprocess and self.session_open and self.session_sent:
            self.spend(
                f"a weight update failed after {len(self.session_sent)} tensors of the session were written "
                f"({error}): the weights are partly updated (SGLang: 'discard the whole weights')"
            )

    def close_session(self) -> None:
        """end_weight_update: with the emulation, lay out again every routed-expert and FP8-linear weight the
        session did not re-send (SGLang's post-processing runs on every module); the engine is then spent."""
        sent, self.session_open, self.session_sent = self.session_sent, False, set()
        if not self.args.emulate_non_idempotent_postprocess:
            return
        stale = sorted(
            name
            for name in self.weights.state()
            if name not in sent and not name.startswith("mtp.") and checkpoint_kind(name) in RELAID_OUT
        )
        if not stale or self.weights.released:
            return
        self.weights.relayout(stale)
        self.spend(
            f"end_weight_update post-processed again {len(stale)} weights this session did not re-send (e.g. "
            f"{stale[0]}), re-laying them out as SGLang does on ROCm: they are corrupt"
        )

    def spend(self, why: str) -> None:
        self.spent = f"{why}; {RESTART}"
        log.error("weights unusable: %s", self.spent)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def get_receiver(self) -> Any:
        """The weight receiver, built on first use (it needs torch.distributed)."""
        if self.receiver is None:
            from dsv4rl.engine.weight_receiver import WeightReceiver

            self.receiver = WeightReceiver(self.weights)
        return self.receiver

    def warmup(self) -> None:
        """SGLang's warmup: one 8-token greedy generate, then status Up."""
        if not self.args.skip_server_warmup:
            request = GenRequest(
                [0], SamplingParams(max_new_tokens=8, temperature=0.0, top_k=1), internal=True
            )
            request.rid = f"WARMUP_{uuid.uuid4().hex}"
            self.generator.submit([request])
            request.done.wait()
        self.status = "Up"
        self.ready.set()
        log.info(READY_LINE)

    def freeze_gc(self) -> None:
        """SGLang's /freeze_gc: every object alive now (imports, the model, the warmup's) moves to the
        permanent generation, so a full collection no longer walks them: without it one took as long as
        a whole generate of the tiny_arith batch, every few requests."""
        before = gc.get_count()
        gc.freeze()
        log.info("Freezing GC in the engine process: %d objects frozen (gen0/1/2 counts were %s)",
                 gc.get_freeze_count(), before)  # fmt: skip

    async def health_generate(self) -> bool:
        """A real 1-token generate; any engine progress counts, as in SGLang (never while paused)."""
        if self.generator.paused:
            self.status = "UnHealthy"
            return False
        request = GenRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0, top_k=1), internal=True)
        request.rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        steps = self.generator.steps
        timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
        self.generator.submit([request])
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if request.finished or self.generator.steps > steps:
                    self.status = "Up"
                    return True
                await asyncio.sleep(0.02)
        finally:
            if not request.finished:
                self.generator.abort(request.rid)
        self.status = "UnHealthy"
        return False

    def model_info(self) -> dict:
        config = self.model.config
        return {
            "model_path": self.args.model_path,
            "served_model_name": self.args.served_model_name or self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.generator.weight_version,
            "load_format": self.args.load_format,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.model_type,
            "architectures": list(config.architectures or []),
        }

    def server_info(self) -> dict:
        info = asdict(self.args)
        counts = self.generator.num_requests()
        info.update(
            context_length=self.context_length,
            launch_command=" ".join(sys.argv),
            status="ready" if self.status == "Up" else self.status.lower(),
            max_total_num_tokens=self.context_length * self.args.max_batch_size,
            max_req_input_len=self.context_length - 1,
            startup_time=self.startup_time,
            kv_events=None,
            internal_states=[
                {
                    "weight_version": self.generator.weight_version,
                    "num_running_reqs": counts["running"],
                    "num_waiting_reqs": counts["waiting"] + counts["held"],
                    "paused": self.generator.paused,
                    "memory_occupation": self.memory.occupation(),  # dsv4rl's: what is held, what released
                    "last_gen_throughput": 0.0,
                }
            ],
            version=VERSION,
            frontend="python",
        )
        for key in ("api_key", "admin_api_key"):
            info[key] = None if info[key] is None else "***"
        return info


def checkpoint_description(model_path: str) -> tuple[tuple[int, int], str]:
    """(FP8 block size, what the checkpoint the engine starts from stores, for refusal messages)."""
    block = block_size(read_config(model_path))
    if not is_native_checkpoint(model_path):
        return block, "a transformers checkpoint"
    try:
        return block, checkpoint_format(model_path).describe()
    except CheckpointError as error:
        return block, str(error)
