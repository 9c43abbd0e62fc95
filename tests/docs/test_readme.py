"""The README is a test: every command block of README.md, and the quick starts of docs/tasks.md and
docs/agents.md, runs in order on a fresh copy of the checkout's tracked files (untracked files cannot make
it pass), with only the changes the README's "The README is a test" paragraph states (doc_blocks.py has
them, each with its reason). A command that fails as written fails the test."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_blocks import (
    AS_PLAN,
    NOT_RUN,
    PLACEHOLDERS,
    PORT_KEYS,
    PORTS,
    ROOT,
    SHORT,
    SKIP_ENGINE_CHECK,
    STEPS,
    all_blocks,
    classify,
    script,
)

from dataset_files import DATA, needs_data

README = (ROOT / "README.md").read_text()


def all_commands():
    return [cmd for block in all_blocks() for cmd in block]


def test_every_rule_changes_some_command() -> None:
    """A rule that matches nothing is stale: the text it changed is gone, and the README's list with it."""
    rules = {rule for cmd in all_commands() for rule in cmd.rules}
    wanted = {f"not run: {start}" for start, _ in NOT_RUN}
    wanted |= {f"as plan: {start}" for start in AS_PLAN}
    wanted |= {f"skip engine check: {start}" for start in SKIP_ENGINE_CHECK}
    wanted |= {f"placeholder {key}" for key in PLACEHOLDERS}
    wanted |= {f"short {kind}" for kind in SHORT} | {"rollouts step"}
    assert wanted <= rules, f"rules that change no command: {sorted(wanted - rules)}"


def test_the_readme_states_what_its_test_changes() -> None:
    assert "tests/docs/test_readme.py" in README
    for overrides in filter(None, SHORT.values()):
        assert f"`{' '.join(overrides)}`" in README, overrides
    assert f"`--step {STEPS}`" in README
    assert all(f"`{key}`" in README for key in PORT_KEYS)
    assert "--skip-engine-check" in README and "not run" in README


def test_every_dsv4rl_command_runs_or_is_planned() -> None:
    """dsv4rl's own commands are never left out: a cluster one is checked as `dsv4rl plan`."""
    for cmd in all_commands():
        if "dsv4rl " in cmd.text and not cmd.text.startswith(("sbatch", "RECIPE=")):
            assert cmd.run, f"{cmd.page}:{cmd.line} is not run: {cmd.text}"


def test_a_run_is_shortened_only_in_what_it_does_not_set() -> None:
    cmd = classify("README.md", 1, "dsv4rl train recipe=tiny_arith run.dir=runs/x algo.group_size=8")
    assert cmd.run == (
        "dsv4rl train recipe=tiny_arith run.dir=runs/x algo.group_size=8"
        f" train.steps={STEPS} algo.prompts_per_step=4 run.save_rollouts=1 {' '.join(PORTS)}"
    )
    background = classify("README.md", 1, "dsv4rl train $C cluster.node_rank=1 &")
    assert background.run.endswith(f" run.save_rollouts=1 {' '.join(PORTS)} &")
    assert classify("README.md", 1, "dsv4rl train recipe=tiny_arith --cfg").run.endswith("--cfg")
    doctor = classify("README.md", 1, "dsv4rl doctor recipe=dapo_math model.path=$M cluster.node_rank=0")
    assert doctor.run == "dsv4rl plan recipe=dapo_math model.path=$M cluster.node_rank=0 --skip-engine-check"
    align = classify("README.md", 1, "dsv4rl align recipe=dapo_math cluster.node_rank=0 --attribute")
    assert align.run == "dsv4rl plan recipe=dapo_math cluster.node_rank=0 --skip-engine-check"
    assert classify("README.md", 1, "dsv4rl rollouts runs/x --step 80 --n 5").run == (
        f"dsv4rl rollouts runs/x --step {STEPS} --n 5"
    )
    assert classify("README.md", 1, "sbatch launch/slurm/dapo_math_4node.sbatch").not_run


def fresh_copy(dest: Path) -> Path:
    """The checkout's tracked files as they are in the working tree: what a clone plus local edits holds."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, check=True
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return dest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def page_env(home: Path, copy: Path) -> dict[str, str]:
    """The tests' environment as a new user's shell: its `dsv4rl` (and the copy's code) on PATH, no W&B
    credentials (the README: offline without them), the data sets where the tests read them."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("WANDB_", "DSV4RL_RECIPES", "PYTEST_")) and key not in ("VIRTUAL_ENV", "NETRC")
    }
    bin_dir = Path(sys.executable).parent
    env.update({f"DSV4RL_TEST_PORT_{i}": str(free_port()) for i in range(len(PORT_KEYS))})
    env.update(
        HOME=str(home),
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(copy / "src"),
        DSV4RL_DATA_DIR=str(DATA.resolve()),
    )
    return env


@pytest.mark.slow
@needs_data
@pytest.mark.timeout(1800)
def test_the_readme_and_the_quick_starts_run_as_written(tmp_path: Path) -> None:
    copy = fresh_copy(tmp_path / "dsv4rl")
    venv = Path(sys.prefix)
    assert (venv / "bin" / "activate").is_file(), f"the tests run outside a virtual environment ({venv})"
    (copy / ".venv").symlink_to(venv)  # what `make install` made: the tests' own environment
    (tmp_path / "home").mkdir()
    (tmp_path / "pages.sh").write_text(script(all_blocks(copy)))
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(tmp_path / "pages.sh")],
        cwd=copy,
        env=page_env(tmp_path / "home", copy),
        capture_output=True,
        text=True,
        timeout=1700,
    )
    output = result.stdout + result.stderr
    tail = "\n".join(output.splitlines()[-150:])
    assert result.returncode == 0 and "DOCTEST PASSED" in result.stdout, tail
    print("\n".join(line for line in output.splitlines() if line.startswith("+ ")))  # each command's start
    print(f"all pages: {time.monotonic() - started:.0f} s")


def test_a_command_that_fails_as_written_fails_the_script(tmp_path: Path) -> None:
    """The script stops at the first failing command, naming its line; a not-run command's missing run dir
    fails it too; a background command that fails is caught at its block's end."""
    cases = {
        "ls runs/nowhere": "README.md:7: ls runs/nowhere",
        "tensorboard --logdir runs/nowhere/tb": "README.md:7: runs/nowhere/tb does not exist",
        "false &": "a background command exited 1",
    }
    for command, named in cases.items():
        result = subprocess.run(
            ["bash", "-c", script([[classify("README.md", 7, command)]])],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 1 and named in result.stderr, (command, result.stderr)
    ok = subprocess.run(
        ["bash", "-c", script([[classify("README.md", 7, "true")]])], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "DOCTEST PASSED" in ok.stdout
