"""SGLang 0.5.23's `return_routed_experts` / `return_indexer_topk` in the reference engine.

SGLang (started with `--enable-return-routed-experts` / `--enable-return-indexer-topk`) records, for
every position it forwards, the experts of each MoE layer and the indexer's kept entries of each CSA
layer, and answers a request that asks with `meta_info["routed_experts"]` / `meta_info["indexer_topk"]`:
base64 of a C-order int32 array, routed experts [seqlen - 1 - routed_experts_start_len,
num_hidden_layers, num_experts_per_tok], indexer top-k [seqlen - 1, CSA layers, index_topk]
(seqlen = prompt + output tokens; the last output token is never forwarded). Hash-routed layers are
never captured, so their rows are zeros; the indexer pads with -1. Without the server flag the fields are
silently absent. Sources: srt/state_capturer/routed_experts.py, state_capturer/base.py (get_topk),
managers/scheduler_components/batch_result_processor.py:136-189, managers/tokenizer_manager.py:2602-2615,
managers/detokenizer_manager.py:430-467 (the base64 step), managers/scheduler.py:3300-3319 (the range
check of routed_experts_start_len).
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4rl.model.replay import ChoiceRecorder
from dsv4rl.wire.choices import encode_int32


class ChoiceCapture:
    """Per-sequence choices of every forwarded position, filled after each forward of the generator."""

    def __init__(self, model: torch.nn.Module, routed: bool, indexer: bool) -> None:
        self.recorder = ChoiceRecorder(model, routed=routed, indexer=indexer)
        self.routed = routed
        self.indexer = indexer

    def after_forward(self, batch: list, prefill: bool) -> None:
        """Append this forward's rows to each request of `batch` (its rows in order). A prefill covers the
        whole sequence so far (a retracted request is recomputed), so it replaces what was kept."""
        routes, topk = self.recorder.take()
        for row, request in enumerate(batch):
            wanted = (
                ("routed", routes, request.return_routed_experts),
                ("indexer", topk, request.return_indexer_topk),
            )
            for kind, values, asked in wanted:
                if values is None or not asked:
                    continue
                rows = values[row].numpy()
                kept = request.captured.setdefault(kind, [])
                if prefill:
                    kept.clear()
                kept.append(rows)

    def meta_fields(self, request) -> dict[str, str]:  # noqa: ANN001 (a GenRequest)
        """The meta_info fields SGLang adds for `request` (none for what it did not ask or the engine
        does not capture)."""
        out = {}
        forwarded = len(request.input_ids) + len(request.output_ids) - 1
        if self.routed and request.return_routed_experts and request.captured.get("routed"):
            rows = np.concatenate(request.captured["routed"])[:forwarded]
            start = min(request.routed_experts_start_len, max(forwarded, 0))
            out["routed_experts"] = encode_int32(rows[start:])
        if self.indexer and request.return_indexer_topk and request.captured.get("indexer"):
            rows = np.concatenate(request.captured["indexer"])[:forwarded]
            out["indexer_topk"] = encode_int32(rows)
        return out
