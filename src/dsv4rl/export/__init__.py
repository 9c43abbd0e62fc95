"""`dsv4rl export`: a training checkpoint (FSDP or Megatron, any layout) as a model directory that SGLang
serves and transformers loads, streamed tensor by tensor (docs/export.md)."""
