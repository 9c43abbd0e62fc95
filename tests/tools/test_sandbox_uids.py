"""Sandbox uids are claimed, so no two live sandboxes on a node share one: a claim held by another process
is skipped, a dead holder's claim is free again, a released one too, and an unsafe registry is refused."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from dsv4rl.tools.sandbox.uids import UID_BASE, UidUnavailable, claim_uid

HOLD = """
import sys, time
from pathlib import Path
from dsv4rl.tools.sandbox.uids import claim_uid
claim = claim_uid([int(sys.argv[1])], registry=Path(sys.argv[2]))
print(claim.uid, flush=True)
time.sleep(60)
"""
CANDIDATES = [UID_BASE + 7, UID_BASE + 8, UID_BASE + 9]


def hold_in_another_process(uid: int, registry) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(uid), str(registry)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == str(uid)
    return holder


def test_a_uid_held_by_another_process_is_skipped_and_free_again_when_it_dies(tmp_path):
    registry = tmp_path / "uids"
    holder = hold_in_another_process(CANDIDATES[0], registry)
    try:
        claim = claim_uid(CANDIDATES, registry=registry)
        assert claim.uid == CANDIDATES[1]
        claim.release()
    finally:
        holder.send_signal(signal.SIGKILL)  # a crashed trainer: no release ran
        holder.wait()
    claim = claim_uid(CANDIDATES, registry=registry)
    assert claim.uid == CANDIDATES[0]
    claim.release()


def test_a_claim_in_this_process_is_held_until_released(tmp_path):
    registry = tmp_path / "uids"
    first = claim_uid(CANDIDATES, registry=registry)
    second = claim_uid(CANDIDATES, registry=registry)
    assert (first.uid, second.uid) == (CANDIDATES[0], CANDIDATES[1])
    first.release()
    first.release()  # twice is harmless
    assert not (registry / str(CANDIDATES[0])).exists()
    again = claim_uid(CANDIDATES, registry=registry)
    assert again.uid == CANDIDATES[0]
    for claim in (second, again):
        claim.release()


def test_every_candidate_held_is_refused_naming_the_cause(tmp_path):
    registry = tmp_path / "uids"
    held = [claim_uid([uid], registry=registry) for uid in CANDIDATES]
    with pytest.raises(UidUnavailable, match="no free sandbox uid"):
        claim_uid(CANDIDATES, registry=registry)
    for claim in held:
        claim.release()


def test_a_registry_others_can_write_is_refused(tmp_path):
    registry = tmp_path / "uids"
    registry.mkdir()
    registry.chmod(0o777)
    with pytest.raises(UidUnavailable, match="writable by it alone"):
        claim_uid(CANDIDATES, registry=registry)
    registry.rmdir()
    registry.symlink_to(tmp_path)
    with pytest.raises(UidUnavailable, match="not a directory owned by this user"):
        claim_uid(CANDIDATES, registry=registry)


@pytest.mark.skipif(os.geteuid() != 0, reason="trajectories get uids of their own only as root")
def test_each_open_trajectory_holds_its_own_uid_until_closed():
    from dsv4rl.tools.python_tool import PythonTool

    tool = PythonTool(isolation="auto")

    async def run() -> None:
        states = [await tool.open({}) for _ in range(3)]
        uids = [state.uid for state in states]
        assert len(set(uids)) == 3 and all(uid >= UID_BASE for uid in uids), uids
        paths = [state.claim.path for state in states]
        assert all(os.path.exists(path) for path in paths)
        for state in states:
            assert os.stat(state.path).st_uid == state.uid
            await tool.close(state)
        assert not any(os.path.exists(path) for path in paths)

    asyncio.run(run())
