"""Weight formats of DeepSeek-V4 checkpoints and engines: FP8 blocks, MXFP4 experts, who gets which.

Pure tensor functions (`fp8`, `mxfp4`, `scales`) and the per-mode wire format (`formats`); no I/O.
"""
