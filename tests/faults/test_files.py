"""Atomic writes that survive a machine crash: the file fsynced before its rename, the directory after."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsv4rl.faults import files
from dsv4rl.faults.files import fsync_tree, read_json, write_json_atomic, write_text_atomic


@pytest.fixture
def fsyncs(monkeypatch) -> list[str]:
    """What os.fsync was called on, in order: a path, "/" ending a directory's."""
    seen: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        seen.append(path + ("/" if os.path.isdir(path) else ""))
        real(fd)

    monkeypatch.setattr(files.os, "fsync", record)
    return seen


def test_a_durable_write_fsyncs_the_data_before_the_rename_and_the_directory_after(
    tmp_path, fsyncs, monkeypatch
):
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(
        files.os, "replace", lambda a, b: (renames.append(len(fsyncs)), real_replace(a, b))[1]
    )
    target = tmp_path / "DONE"
    write_json_atomic(target, {"status": "finished"})
    assert read_json(target) == {"status": "finished"}
    tmp_file, directory = fsyncs
    assert Path(tmp_file).name.startswith(".DONE.") and directory == f"{tmp_path}/"
    assert renames == [1]  # after the file's fsync, before the directory's
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_heartbeat_write_is_not_fsynced(tmp_path, fsyncs):
    write_json_atomic(tmp_path / "hb.json", {"phase": "train"}, durable=False)
    assert fsyncs == [] and read_json(tmp_path / "hb.json") == {"phase": "train"}


def test_a_failed_write_leaves_the_old_file_and_no_tmp(tmp_path, monkeypatch):
    target = tmp_path / "config.yaml"
    write_text_atomic(target, "old\n")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(target, "new\n")
    assert target.read_text() == "old\n" and not list(tmp_path.glob(".*.tmp"))


def test_fsync_tree_covers_every_file_then_the_directories_deepest_first(tmp_path, fsyncs):
    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    for name in ("ckpt/a.distcp", "ckpt/.metadata", "ckpt/sub/b"):
        (tmp_path / name).write_text(name)
    fsync_tree(tmp_path / "ckpt")
    files_seen = [p for p in fsyncs if not p.endswith("/")]
    dirs_seen = [p for p in fsyncs if p.endswith("/")]
    assert sorted(Path(p).name for p in files_seen) == [".metadata", "a.distcp", "b"]
    assert dirs_seen == [f"{tmp_path}/ckpt/sub/", f"{tmp_path}/ckpt/"]
    assert fsyncs.index(dirs_seen[0]) > max(fsyncs.index(p) for p in files_seen)
