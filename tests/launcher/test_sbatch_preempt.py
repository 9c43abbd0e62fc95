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


def fake_slurm(tmp_path: Path, srun: str, scontrol: str) -> tuple[Path, Path]:
    """`bin/` with the fake srun and scontrol scripts, and the `out/` directory they write to."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name, body in (("srun", srun), ("scontrol", scontrol)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return bin_dir, out


def test_preempt_sbatch_stops_the_run_on_usr1_and_requeues(tmp_path: Path) -> None:
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@1800" in text and "#SBATCH --requeue" in text
    bin_dir, out = fake_slurm(tmp_path, FAKE_SRUN, FAKE_SCONTROL)
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


FAKE_SRUN_FAILED_PUSH = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_OUT/srun-args"
run_dir=$(printf '%s\\n' "$@" | sed -n 's/^run.dir=//p')
[[ -e $run_dir/FAILED_PUSH ]] && touch "$FAKE_OUT/stale-record-seen"
record='{"step": 3, "checkpoint": "%s/checkpoints/step_00000002", "requeue": %s}\\n'
printf "$record" "$run_dir" "$FAKE_REQUEUE" > "$run_dir/FAILED_PUSH"
exit 76
"""
FAKE_SCONTROL_ANY = """#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then
  for i in $(seq 1 "$FAKE_NODES"); do echo "gpu-b0$i"; done; exit 0
fi
echo "$*" >> "$FAKE_OUT/scontrol"
"""


def run_failed_push_job(tmp_path: Path, requeue: str, **env_overrides: str) -> subprocess.CompletedProcess:
    """The script around an srun whose node 0 ended with a failed push (exit 76 and its record, as
    `dsv4rl.faults.failed_push` writes it); an earlier start's record lies in the run dir."""
    bin_dir, out = fake_slurm(tmp_path, FAKE_SRUN_FAILED_PUSH, FAKE_SCONTROL_ANY)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_OUT": str(out),
        "FAKE_REQUEUE": requeue,
        "FAKE_NODES": "4",
        "SLURM_JOB_NODELIST": "gpu-b[01-04]",
        "SLURM_JOB_ID": "4343",
        "SLURM_SUBMIT_DIR": str(tmp_path / "submit"),
        "MODEL_PATH": "/shared/models/DeepSeek-V4-Flash",
        "DSV4RL_DATA_DIR": "/shared/data",
        **env_overrides,
    }
    recipe = env.get("RECIPE", "dapo_math")
    run_dir = tmp_path / "submit" / "runs" / f"{recipe}-4343"
    run_dir.mkdir(parents=True)
    (run_dir / "FAILED_PUSH").write_text('{"step": 1, "requeue": true}\n')  # an earlier start's
    return subprocess.run(["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_a_failed_push_requeues_the_job_when_its_record_allows(tmp_path: Path) -> None:
    result = run_failed_push_job(tmp_path, "true")
    out = tmp_path / "out"
    assert result.returncode == 76, result.stderr
    assert not (out / "stale-record-seen").exists()  # removed before srun started
    assert (out / "scontrol").read_text().split() == ["requeue", "4343"]
    assert "requeueing job 4343 with fresh engines" in result.stderr
    assert "resume=auto" in (out / "srun-args").read_text().splitlines()


def test_a_failed_push_past_max_requeues_is_not_requeued(tmp_path: Path) -> None:
    result = run_failed_push_job(tmp_path, "false")
    assert result.returncode == 76, result.stderr
    assert not (tmp_path / "out" / "scontrol").exists()
    assert "cluster.max_requeues is used up" in result.stderr and "not requeued" in result.stderr


def test_the_nvidia_recipe_runs_on_the_jobs_six_nodes(tmp_path: Path) -> None:
    result = run_failed_push_job(tmp_path, "false", RECIPE="dapo_math_h200", FAKE_NODES="6",
                                 SLURM_JOB_NODELIST="gpu-b[01-06]")  # fmt: skip
    args = (tmp_path / "out" / "srun-args").read_text().splitlines()
    assert "--nodes=6" in args and "--ntasks=6" in args and "recipe=dapo_math_h200" in args
    assert "cluster.node_addrs=['gpu-b01','gpu-b02','gpu-b03','gpu-b04','gpu-b05','gpu-b06']" in args
    assert "recipe dapo_math_h200" in result.stdout
