"""`dsv4rl plan`'s estimates: memory per GPU and time per step, pure arithmetic on the recipe.

`devices` holds the accelerators' data-sheet numbers, `params` the model's parameter counts and the bytes
of each weight format, `memory` the per-GPU memory plan, `step_time` the rollout/train/sync estimate.
Nothing here starts a process or reads the machine.
"""
