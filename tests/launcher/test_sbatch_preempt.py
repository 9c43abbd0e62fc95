"""The sbatch script under preemption: it asks Slurm for USR1 before the time limit and to be requeued,
passes resume=auto, and on USR1 writes the run's STOP request, waits for srun, and requeues the job once the
trainer recorded its stop. Run under fake `srun` (the run: it waits for STOP, then stops as trainer rank 0
does) and `scontrol` (records the requeue)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm" / "dapo_math_4node.sbatch"

FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_OUT/srun-args"
run_dir=$(printf '%s\\n' "$@" | sed -n 's/^run.dir=//p')
touch "$FAKE_OUT/srun-started"
while [[ ! -f $run_dir/STOP ]]; do sleep 0.05; done
cp "$run_dir/STOP" "$FAKE_OUT/stop-request"
echo '{"step": 7, "checkpoint": "step_00000007"}' > "$run_dir/STOPPED"
exit 75
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\\n' gpu-a01 gpu-a02 gpu-a03 gpu-a04; exit 0; fi
echo "$*" >> "$FAKE_OUT/scontrol"
"""


def test_preempt_sbatch_stops_the_run_on_usr1_and_requeues(tmp_path: Path) -> None:
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@1800" in text and "#SBATCH --requeue" in text
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_OUT": str(out),
        "SLURM_JOB_NODELIST": "gpu-a[01-04]",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(tmp_path / "submit"),
        "MODEL_PATH": "/shared/models/DeepSeek-V4-Flash",
        "DSV4RL_DATA_DIR": "/shared/data",
    }
    script = subprocess.Popen(
        ["bash", str(SBATCH)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "srun-started").exists():
            assert script.poll() is None and time.monotonic() < deadline, script.communicate()
            time.sleep(0.05)
        os.kill(script.pid, signal.SIGUSR1)  # what --signal=B:USR1 sends: to the batch shell only
        stdout, stderr = script.communicate(timeout=60)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 75, stderr
    assert "resume=auto" in (out / "srun-args").read_text().splitlines()
    assert json.loads((out / "stop-request").read_text())["reason"].startswith("USR1 from Slurm")
    assert (out / "scontrol").read_text().split() == ["requeue", "4242"]
    assert "requeueing job 4242" in stderr
