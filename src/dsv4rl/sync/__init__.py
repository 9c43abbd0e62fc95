"""Checkpoint-free weight sync: trainer rank 0 broadcasts to the engines over a custom process group."""
