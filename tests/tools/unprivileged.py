"""Run a command as an unprivileged uid from a test that runs as root (as CI does).

The test's interpreter may live where that uid cannot go (pyenv under /root, mode 0700). The command then
runs in a private mount namespace where each such directory is replaced by a 0755 tmpfs holding only the
path down to the interpreter (bind-mounted back), so the uid reaches the interpreter and nothing else of
that directory; then `setpriv` drops to the uid with no capabilities, no supplementary groups and an empty
bounding set, as a user's own login would be.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import sys
from pathlib import Path

UID = 4242  # no passwd entry needed


def can_run_as_unprivileged() -> str | None:
    """None when the tests can drop to UID here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "needs root to drop to another uid (run the suite as root, as CI does)"
    for tool in ("unshare", "setpriv", "mount"):
        if not shutil.which(tool):
            return f"needs `{tool}` (util-linux)"
    return None


def _closed_ancestors(paths: list[str]) -> dict[str, set[str]]:
    """Directories others cannot traverse on the way to `paths` -> the children the paths go through."""
    closed: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(path).resolve().parts
        for depth in range(1, len(parts) - 1):
            directory = str(Path(*parts[: depth + 1]))
            if not os.stat(directory).st_mode & stat.S_IXOTH:
                closed.setdefault(directory, set()).add(parts[depth + 1])
    return closed


def unprivileged_argv(argv: list[str], workdir: str, uid: int = UID) -> list[str]:
    """`argv` run as `uid` in `workdir` (see the module docstring)."""
    needed = [sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix]
    lines = ["set -e"]
    for n, (directory, children) in enumerate(sorted(_closed_ancestors(needed).items())):
        keep = f"{workdir}/.keep{n}"
        lines.append(f"mkdir -p {keep} && mount --bind {shlex.quote(directory)} {keep}")
        lines.append(f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(directory)}")
        for child in sorted(children):
            inside = shlex.quote(f"{directory}/{child}")
            lines.append(f"mkdir -p {inside} && mount --bind {keep}/{shlex.quote(child)} {inside}")
    drop = [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ]
    lines.append(f"cd {shlex.quote(workdir)} && exec {shlex.join(drop + argv)}")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)]
