"""The wire form of an engine's routing and indexer choices (SGLang 0.5.23's meta_info fields
`routed_experts` and `indexer_topk`): base64 of C-order int32 bytes, one row per forwarded position
(srt/managers/detokenizer_manager.py:430-447 encodes, srt/state_capturer/routed_experts.py:166-174 shows
the client's decode). Shared by the reference engine, which writes it, and the rollout, which reads it."""

from __future__ import annotations

import base64

import numpy as np


def encode_int32(array: np.ndarray) -> str:
    """base64 of the array's int32 bytes (little-endian, C order)."""
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode("ascii")


def decode_rows(text: str, rows: int, what: str) -> np.ndarray:
    """The flat int32 buffer as [rows, width]; a buffer that does not split into `rows` rows is an error
    naming the field (the engine and the request disagree on which positions it covers)."""
    flat = np.frombuffer(base64.b64decode(text), dtype="<i4")
    if rows <= 0 or flat.size % rows:
        raise ValueError(
            f"meta_info[{what!r}] holds {flat.size} int32 values, not a whole number of rows for {rows} "
            "forwarded positions (prompt + response - 1)"
        )
    return flat.reshape(rows, -1).astype(np.int32)
