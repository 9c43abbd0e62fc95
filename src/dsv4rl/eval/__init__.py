"""Evaluation: eval sets, pass@k / avg@n / maj@n, `dsv4rl eval` and training's periodic eval."""
