"""GRPO / DAPO maths as pure tensor functions (no model, no distributed state)."""
