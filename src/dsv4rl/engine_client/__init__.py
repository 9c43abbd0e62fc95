"""The HTTP client of the rollout engines (SGLang and the reference engine alike): requests, the pool,
the engines' keys and the colocated memory calls. The engines themselves are `dsv4rl.engine`."""
