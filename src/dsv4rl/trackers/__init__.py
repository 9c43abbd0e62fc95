"""Experiment trackers (`logger=[jsonl,tensorboard,wandb]`): TensorBoard event files and Weights & Biases
runs beside metrics.jsonl, written by rank 0 (`hub.Trackers`) and closed with the run's outcome by the
launcher (`outcome.record_outcome`). A tracker that fails is reported once and dropped; the run goes on."""
