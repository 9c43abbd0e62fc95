"""Training side: batches, the FSDP train engine, checkpoints, the training loop."""
