"""Number formats of DeepSeek-V4 weights: FP8 blocks, MXFP4 experts, their scales, and SGLang's rules.

Pure tensor functions (`fp8`, `mxfp4`, `scales`, `formats.dequantize`) and SGLang's environment rules
(`sglang_env`); no I/O. Which checkpoint tensor gets which format is `dsv4rl.model.wire_format`'s.
"""
