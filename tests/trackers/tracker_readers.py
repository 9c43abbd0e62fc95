"""Read trackers' files back as their own tools do: TensorBoard's event reader, and the records of an
offline W&B run (`run-<id>.wandb`: wandb's protobuf records in LevelDB's log format, which is how wandb
writes them; the SDK ships no public reader of its own)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # LevelDB log blocks
HEADER = 7  # wandb's file header (":W&B", magic, version); each record's header is also 7 bytes
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the event files under `directory`, as TensorBoard shows them
    (events of steps a resumed run purged are dropped by the reader)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(directory), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["tensors"]:
        if tag.endswith("/text_summary"):
            continue
        for event in acc.Tensors(tag):
            steps = out.setdefault(tag, {})
            # a step twice: the events of a resumed run's redone steps were not purged (a zigzag in the plot)
            assert event.step not in steps, f"{tag}: step {event.step} written twice"
            steps[event.step] = tensor_util.make_ndarray(event.tensor_proto).item()
    return out


def tensorboard_texts(directory: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    acc.Reload()
    out: dict[str, list[str]] = {}
    for tag in acc.Tags()["tensors"]:
        if not tag.endswith("/text_summary"):
            continue
        for event in acc.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto)
            out.setdefault(tag.removesuffix("/text_summary"), []).append(value.item().decode())
    return out


def wandb_records(path: Path) -> list:
    """Every record of one `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb datastore file"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        chunk, pos = data[pos : pos + length], pos + length
        if kind == 0 and length == 0:
            break
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
    out = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def _files(run_dir: Path, run_id: str) -> list[Path]:
    """Every segment's `.wandb` file, oldest first (dsv4rl's own listing: what `wandb sync` is told)."""
    from dsv4rl.trackers.wandb_log import offline_segments

    return [path / f"run-{run_id}.wandb" for path in offline_segments(run_dir, run_id)]


def wandb_history(run_dir: Path, run_id: str) -> dict[int, dict]:
    """{step: logged values} over every offline segment of W&B run `run_id` (later segments win)."""
    history: dict[int, dict] = {}
    for path in _files(run_dir, run_id):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history[int(row["_step"])] = row
    return history


def wandb_summary(run_dir: Path, run_id: str) -> dict:
    summary: dict = {}
    for path in _files(run_dir, run_id):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "summary":
                for item in record.summary.update:
                    key = item.key or "/".join(item.nested_key)
                    summary[key] = json.loads(item.value_json)
    return summary


def wandb_config(run_dir: Path, run_id: str) -> dict:
    config: dict = {}
    for path in _files(run_dir, run_id):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            items = (
                record.config.update
                if kind == "config"
                else record.run.config.update
                if kind == "run"
                else []
            )
            for item in items:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config
