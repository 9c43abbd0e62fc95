"""The `fsdp` trainer backend: PyTorch FSDP2 over transformers' DeepSeek-V4 (any size that fits)."""
