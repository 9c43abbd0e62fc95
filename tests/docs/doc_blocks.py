"""The command blocks of README.md and of the quick starts of docs/tasks.md and docs/agents.md, and what the
README test (tests/docs/test_readme.py) changes in them before it runs them.

A page's ```bash blocks are read in order; a line ending in `\\` joins the next. Each command is then run as
written, with these changes, every one stated in the README's "The README is a test" paragraph:

- training and align runs of the tiny recipes are shortened (`SHORT[...]` appended, a key the line sets
  itself kept: `algo.group_size=8` stays 8), these and eval runs get free ports (`PORTS`); `--step N` of
  `dsv4rl rollouts` reads the last shortened step; placeholders (`/path/to/data`) name real things;
- a command that needs a cluster is checked as `dsv4rl plan` with the same overrides (`AS_PLAN`), and a
  plan of a cluster recipe skips the SGLang interpreter check, which fails on any machine that is not a
  GPU node (`--skip-engine-check`, as the README says for such machines);
- a command that needs a GPU, a cluster, an account or a UI, or that CI already runs, is not run
  (`NOT_RUN`, each with its reason); the run-dir paths it names must exist;
- `dsv4rl doctor` may exit 1: its verdict on a FAIL row of this host (the README: "Exit code 1 on any
  FAIL"), not the command failing.

Every rule must match some line (a rule nothing matches fails the fast test), so the rules cannot outlive
the text they change."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Which blocks of each page run: README.md all of them, the docs pages their quick start (the first).
PAGES: dict[str, int | None] = {"README.md": None, "docs/tasks.md": 1, "docs/agents.md": 1}

STEPS = 2
SHORT: dict[str, tuple[str, ...]] = {
    "train": (f"train.steps={STEPS}", "algo.prompts_per_step=4", "algo.group_size=4", "run.save_rollouts=1"),
    "eval": (),  # as written: 16 one-token problems (the engine's start is most of it), ports only
    "align": ("align.prompts=4", "align.samples_per_prompt=2"),
}
# every run that starts processes: ports the test picks free, so that it runs beside another run on the
# machine (a demo, another test); both nodes of the two-node example get the same ones, as the text's would
PORT_KEYS = ("engine.port", "cluster.master_port", "cluster.weight_sync_port")
PORTS = tuple(f"{key}=${{DSV4RL_TEST_PORT_{i}}}" for i, key in enumerate(PORT_KEYS))
PLACEHOLDERS = {"/path/to/data": "$DSV4RL_DATA_DIR"}  # the test's data sets

# (the command as it starts, why the test does not run it)
NOT_RUN: tuple[tuple[str, str], ...] = (
    ("make install GPU=1", "a GPU machine's install (CUDA or ROCm torch)"),
    ("make install-sglang", "builds SGLang's environment (minutes, 11 GB); CI's install runs it"),
    ("make install", "CI installs with it before the tests; the test's clone uses the tests' environment"),
    ("make test", "CI runs it, and this test is part of it"),
    ("make lint", "CI runs it"),
    ("make bench", "a benchmark of minutes; tests/test_bench.py runs the benches --quick"),
    ("python bench/", "a benchmark of minutes; tests/test_bench.py runs the benches --quick"),
    ("tensorboard ", "a web UI that serves until stopped; the test checks that its log directory exists"),
    ("wandb sync ", "uploads to a W&B account over the network; the test checks that the offline run exists"),
    ("python -m sglang.launch_server", "serving needs SGLang on a GPU; the sglang tests read every export"),
    ("sbatch ", "a Slurm cluster"),
    ("RECIPE=dapo_math_h200 sbatch ", "a Slurm cluster"),
)
# dsv4rl commands that need a cluster's nodes, checked as `dsv4rl plan` with the same overrides
AS_PLAN: tuple[str, ...] = ("dsv4rl doctor recipe=dapo_math", "dsv4rl align recipe=dapo_math")
# a plan of a cluster recipe (SGLang engines) on a machine that is not a GPU node: that recipe itself, not
# dapo_math_tir, whose plan runs no engine check
SKIP_ENGINE_CHECK = ("dsv4rl plan recipe=dapo_math",)

_COMMAND = re.compile(r"(?:^|\s)(?:\S*/)?dsv4rl (\w+)")
_STEP = re.compile(r"--step \d+")
_FLAG = re.compile(r"\s--[\w-]+(?=\s|$)")


@dataclass
class Command:
    page: str
    line: int  # 1-based, of the command's first line
    text: str  # as written, continuation lines joined, without its trailing comment
    run: str = ""  # what the test runs ("" when not run)
    not_run: str = ""  # why not
    ok_codes: tuple[int, ...] = (0,)
    rules: list[str] = field(default_factory=list)  # which rules changed it


def code_part(line: str) -> str:
    """The line without its trailing `# comment` (a `#` outside quotes after a blank)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def blocks(page: str, text: str) -> list[list[tuple[int, str]]]:
    """Each ```bash block of a page: its commands as (line number, command without comment)."""
    found: list[list[tuple[int, str]]] = []
    current: list[tuple[int, str]] | None = None
    pending = ""
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        if current is None:
            if line.strip() == "```bash":
                current = []
            continue
        if line.strip() == "```":
            assert not pending, f"{page}:{start}: a continued line ends the block"
            found.append(current)
            current = None
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = code_part(pending + line)
        pending = ""
        if command:
            current.append((start, command))
    assert current is None, f"{page}: a ```bash block is not closed"
    return found


def _has_key(command: str, key: str) -> bool:
    return re.search(rf"(?:^|[\s'\"+~]){re.escape(key)}=", command) is not None


def _shorten(kind: str, command: str) -> tuple[str, list[str]]:
    extra = [item for item in (*SHORT[kind], *PORTS) if not _has_key(command, item.split("=")[0])]
    if not extra:
        return command, []
    background = command.endswith("&")
    body = command[:-1].rstrip() if background else command
    return f"{body} {' '.join(extra)}" + (" &" if background else ""), [f"short {kind}"]


def plan_of(command: str) -> str:
    """`dsv4rl doctor|align ARGS` as `dsv4rl plan` with the same overrides (its own `--flags` left out)."""
    plan = _COMMAND.sub(lambda match: match.group(0).replace(match.group(1), "plan"), command, count=1)
    return f"{_FLAG.sub('', plan)} --skip-engine-check"


def classify(page: str, line: int, text: str) -> Command:
    """What the test does with one command of a page."""
    cmd = Command(page, line, text)
    for start, why in NOT_RUN:
        if text.startswith(start):
            cmd.not_run, cmd.rules = why, [f"not run: {start}"]
            return cmd
    run = text
    for placeholder, value in PLACEHOLDERS.items():
        if placeholder in run:
            run = run.replace(placeholder, value)
            cmd.rules.append(f"placeholder {placeholder}")
    for start in AS_PLAN:
        if run.startswith(start):
            cmd.run, cmd.rules = plan_of(run), [*cmd.rules, f"as plan: {start}"]
            return cmd
    for start in SKIP_ENGINE_CHECK:
        if re.match(rf"{re.escape(start)}(\s|$)", run) and "--skip-engine-check" not in run:
            run += " --skip-engine-check"
            cmd.rules.append(f"skip engine check: {start}")
    match = _COMMAND.search(run)
    sub = match.group(1) if match else ""
    if sub in SHORT and "--cfg" not in run and "--responses" not in run:
        run, rules = _shorten(sub, run)
        cmd.rules += rules
    if sub == "rollouts" and _STEP.search(run):
        run = _STEP.sub(f"--step {STEPS}", run)
        cmd.rules.append("rollouts step")
    if sub == "doctor":
        cmd.ok_codes = (0, 1)
    cmd.run = run
    return cmd


def page_commands(page: str, root: Path = ROOT) -> list[list[Command]]:
    """The blocks of a page that the test runs, each as its classified commands."""
    found = blocks(page, (root / page).read_text())
    wanted = PAGES[page]
    chosen = found if wanted is None else found[:wanted]
    return [[classify(page, line, text) for line, text in block] for block in chosen]


def run_dir_paths(command: str) -> list[str]:
    """The run-dir and export paths a command names (`runs/...`, `exports/...`), for the not-run ones."""
    return [word for word in shlex.split(command) if word.startswith(("runs/", "exports/"))]


def all_blocks(root: Path = ROOT) -> list[list[Command]]:
    """The blocks the test runs, README.md's first, then each docs page's quick start."""
    return [block for page in PAGES for block in page_commands(page, root)]


def script(page_blocks: list[list[Command]]) -> str:
    """One bash script running the commands in order, stopping at the first that fails. A command run
    word for word before (a docs quick start repeating the README, the README itself) is not run again."""
    lines = ["pids=()", 'fail() { echo "DOCTEST FAILED: $1" >&2; exit 1; }']
    ran: dict[str, str] = {}
    for block in page_blocks:
        for cmd in block:
            where = f"{cmd.page}:{cmd.line}"
            if cmd.run and cmd.text in ran:
                lines.append(f"echo {shlex.quote(f'+ {where} ran above at {ran[cmd.text]}: {cmd.text}')}")
                continue
            ran.setdefault(cmd.text, where)
            if cmd.not_run:
                lines.append(f"echo {shlex.quote(f'+ {where} not run ({cmd.not_run}): {cmd.text}')}")
                for path in run_dir_paths(cmd.text):
                    check = f"{where}: {path} does not exist for: {cmd.text}"
                    lines.append(f"compgen -G {shlex.quote(path)} >/dev/null || fail {shlex.quote(check)}")
                continue
            lines.append(f'echo "+ [$SECONDS s] "{shlex.quote(f"{where}: {cmd.run}")}')
            lines.append(cmd.run)
            if cmd.run.endswith("&"):
                lines.append("pids+=($!)")
                continue
            codes = " ".join(str(code) for code in cmd.ok_codes)
            failed = shlex.quote(f"{where}: {cmd.run}")
            check = f'case " {codes} " in *" $rc "*) ;; *) fail "exit code $rc at "{failed};; esac'
            lines.append(f"rc=$?; {check}")
        lines.append('for pid in "${pids[@]}"; do wait "$pid" || fail "a background command exited $?"; done')
        lines.append("pids=()")
    lines.append('echo "DOCTEST PASSED in $SECONDS s"')
    return "\n".join(lines) + "\n"
