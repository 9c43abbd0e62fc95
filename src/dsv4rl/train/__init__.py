"""Training side: the RL loop, the update loop and its trainer backends (fsdp, megatron), checkpoints."""
