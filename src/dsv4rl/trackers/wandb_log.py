"""Weights & Biases: one W&B run per dsv4rl run, offline unless credentials are set.

Online when `WANDB_API_KEY` is set or a netrc file holds a password for the W&B host (what `wandb login`
writes), unless `WANDB_MODE` says otherwise; offline, the run goes to `<run.dir>/wandb/offline-run-*`
and `wandb sync` uploads it later (`sync_command`). A resumed run continues the same W&B run: the same
id with `resume="allow"` (offline, each segment is a directory of its own; `wandb sync` takes them all).
"""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from dsv4rl.config.schema import WandbConfig

DEFAULT_HOST = "https://api.wandb.ai"
WANDB_DIR = "wandb"


def has_credentials(environ: Mapping[str, str] | None = None) -> bool:
    """An API key in the environment, or a netrc entry with a password for the W&B host."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or DEFAULT_HOST).hostname or ""
    path = Path(env.get("NETRC") or Path.home() / ".netrc")
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def wandb_mode(environ: Mapping[str, str] | None = None) -> str:
    """`WANDB_MODE` when set (online, offline, disabled); else online with credentials, offline without."""
    env = os.environ if environ is None else environ
    mode = env.get("WANDB_MODE")
    if mode:
        return "offline" if mode == "dryrun" else mode
    return "online" if has_credentials(env) else "offline"


def offline_segments(run_dir: str | Path, run_id: str) -> list[Path]:
    """The offline directories of W&B run `run_id`, oldest first: `offline-run-<time>-<id>`, and
    `...-<id>-N` when a segment starts in the same second as the one before."""
    root = Path(run_dir) / WANDB_DIR
    found = [*root.glob(f"offline-run-*-{run_id}"), *root.glob(f"offline-run-*-{run_id}-*")]
    return sorted(found, key=lambda path: path.name)


def sync_command(run_dir: str | Path, run_id: str) -> str:
    """The command that uploads an offline run (every segment of it, in order)."""
    return f"wandb sync {Path(run_dir) / WANDB_DIR}/offline-run-*-{run_id}*"


class WandbTracker:
    name = "wandb"

    def __init__(
        self,
        settings: WandbConfig,
        run_dir: str | Path,
        run_id: str,
        mode: str,
    ) -> None:
        import wandb

        self.run_dir, self.run_id, self.mode = Path(run_dir), run_id, mode
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name or self.run_dir.name,
            tags=list(settings.tags) or None,
            group=settings.group,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=mode,
            # no console capture, no code or git snapshot: the run dir has the logs and config.yaml
            settings=wandb.Settings(silent=True, console="off", save_code=False, disable_git=True),
        )

    def log_config(self, config: Mapping[str, object]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_plan(self, plan: Mapping[str, object]) -> None:
        self.run.config.update({"plan": dict(plan)}, allow_val_change=True)

    def log_step(self, step: int, metrics: Mapping[str, object]) -> None:
        values = {k: v for k, v in metrics.items() if k != "step" and v is not None}
        self.run.log(values, step=step)

    def log_outcome(self, outcome: str, root_cause: str | None, step: int) -> None:
        self.run.summary["outcome"] = outcome
        self.run.summary["root_cause"] = root_cause
        self.run.summary["last_step"] = step

    def close(self) -> None:
        import wandb

        self.run.finish()
        # `finish` returns once the run is marked done, while wandb-core may still be writing the last
        # records (the summary, the outcome) to the offline `.wandb` file; seen on a busy machine: the
        # file read right after close lacked the outcome. Tearing the service down waits for every stream
        # to be written; one run per process is all dsv4rl opens, and a later `wandb.init` starts anew.
        wandb.teardown()
