"""Tools a model calls during a multi-turn rollout (`rollout.mode=tools`): the protocol, the built-ins."""
