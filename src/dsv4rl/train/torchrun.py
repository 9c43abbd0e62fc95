"""torchrun as the node supervisor starts it: `python -m dsv4rl.train.torchrun <torchrun arguments>`.

A stop signal must reach each trainer rank once. Slurm delivers `--signal` and a preemption's SIGTERM to
every process of the job step, torchrun included, and torchrun would pass SIGTERM on to its workers (a
second signal, which stops a rank at once, `dsv4rl.faults.stop`) and kill them 30 s later. So here torchrun
ignores SIGTERM and SIGUSR1 with a handler that does nothing (exec resets handlers, so its workers keep
their defaults) and handles only SIGINT, SIGHUP and SIGQUIT (`TORCHELASTIC_SIGNALS_TO_HANDLE`). The
supervisor stops it with SIGINT, which it passes on, and which ends a rank at once.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
HANDLED = "SIGINT,SIGHUP,SIGQUIT"


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Not SIG_IGN: an ignored disposition would be inherited by the workers."""


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _ignore)
    os.environ[SIGNALS_ENV] = HANDLED
    from torch.distributed.run import main as torchrun

    torchrun()  # reads sys.argv[1:], as `python -m torch.distributed.run` does


if __name__ == "__main__":
    main()
