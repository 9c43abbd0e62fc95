"""What every check receives: the probe, the node's facts, and the recipe (None: no recipe given)."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4rl.config.schema import Config
from dsv4rl.doctor.facts import NodeFacts
from dsv4rl.doctor.probe import SystemProbe

NO_RECIPE = "no recipe given (pass recipe=NAME to check against it)"


@dataclass
class Context:
    probe: SystemProbe
    facts: NodeFacts
    cfg: Config | None

    @property
    def gpu_node(self) -> bool:
        """A node with GPUs, or one the recipe says has them: host settings then matter."""
        return self.facts.has_gpu or (self.cfg is not None and self.cfg.cluster.gpus_per_node > 0)

    @property
    def multi_node(self) -> bool:
        return self.cfg is not None and self.cfg.cluster.nnodes > 1

    def recipe_env(self) -> dict[str, str]:
        """The recipe's comm preset (comm.env), as strings; {} without a recipe."""
        if self.cfg is None:
            return {}
        return {str(k): str(v) for k, v in self.cfg.comm.env.items()}

    def process_env(self) -> dict[str, str]:
        """What the run's processes get: this shell's environment, comm.env over it (the planner's rule)."""
        return {**self.facts.env, **self.recipe_env()}
