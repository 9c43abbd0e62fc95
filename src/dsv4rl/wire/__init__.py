"""What the trainer, the rollout client and the reference engine share: the weight-update wire format
(bucket layout, dtype names, tensor payloads, checksums, the custom process group), the engine API they
call, and the sampling-seed mixing; it imports nothing else of dsv4rl."""
