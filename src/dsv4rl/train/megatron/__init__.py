"""The `megatron` trainer backend: DeepSeek-V4 built in megatron-core, with TP/PP/EP (the Flash scale)."""
