"""Sandbox uids that no other live sandbox on the node holds.

Run as root, each trajectory's code (and each probe's trial) runs under a uid of its own: the uid keeps two
programs from signalling or reading each other, and cleanup kills every process of it. Two sandboxes on
one uid would lose both: one trajectory's cleanup would kill the other's running code, silently turning
its tool result into an error. Drawn at random from 2**24 uids, a node with ~500 live trajectories meets
such a pair about once per 33,000 trajectories, so once or twice in a 100-step run; the draw is therefore
claimed. A claim is an flock on a file named after the uid in a root-only directory: the kernel drops
the lock when its holder dies, so a crashed trainer's uids are free again without any repair.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

UID_BASE = 0x70000000  # sandbox uids: UID_BASE + a 24-bit number, far above any account's uid
UID_SPAN = 1 << 24
_ATTEMPTS = 10_000


class UidUnavailable(RuntimeError):
    """No sandbox uid could be claimed (the registry is unsafe, or every candidate is held)."""


def default_registry() -> Path:
    """One directory every process of the node sees: /dev/shm where there is one (not $TMPDIR, which
    differs between processes)."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path("/tmp")) / "dsv4rl-sandbox-uids"


@dataclass
class UidClaim:
    """A uid held until `release` or the holder's death."""

    uid: int
    path: str
    fd: int

    def release(self) -> None:
        """Free the uid: the file goes first, so a claimant that opened it meanwhile sees a stale file."""
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1


def _registry_dir(registry: Path) -> Path:
    """The registry, made root-only; refused where another user could create or hold its files."""
    try:
        registry.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(registry)
    except OSError as error:
        raise UidUnavailable(f"the sandbox uid registry {registry} cannot be made: {error}") from error
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise UidUnavailable(
            f"the sandbox uid registry {registry} is not a directory owned by this user and writable by it "
            f"alone (mode {stat.filemode(info.st_mode)}, owner {info.st_uid}): another user could hold "
            "sandbox uids; remove it (it is re-made at the next claim)"
        )
    return registry


def _random_uids() -> Iterator[int]:
    while True:
        yield UID_BASE + random.randrange(UID_SPAN)


def claim_uid(candidates: Iterable[int] | None = None, registry: Path | None = None) -> UidClaim:
    """The first free uid of `candidates` (default: random sandbox uids), held until released."""
    directory = _registry_dir(registry or default_registry())
    for attempt, uid in enumerate(candidates if candidates is not None else _random_uids()):
        if attempt >= _ATTEMPTS:
            break
        path = str(directory / str(uid))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # released and unlinked meanwhile
            os.close(fd)
            continue
        return UidClaim(uid, path, fd)
    raise UidUnavailable(
        f"no free sandbox uid among the candidates tried ({_ATTEMPTS} at most) in {directory}: too many "
        "live sandboxes on this node; lower the rollout's concurrency"
    )
