"""The start-up hook the planner gives SGLang engines: the weight-update group gets `sync.timeout_s`.

A stand-in `sglang.srt.utils.common` with SGLang 0.5.23's signature (`init_custom_process_group(backend,
init_method, timeout=None, ...)`, re-exported by `sglang.srt.utils` with `import *`) runs in a fresh
interpreter with the planner's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dsv4rl.config.compose import compose
from dsv4rl.launcher.plan import SGLANG_SITE, WEIGHT_SYNC_TIMEOUT_ENV, sglang_env

FAKE_COMMON = """
def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                              store=None, group_name=None, pg_options=None, device_id=None):
    return {"timeout": None if timeout is None else timeout.total_seconds(), "group_name": group_name}
"""
PROBE = """
import datetime
import json
from sglang.srt.utils import init_custom_process_group  # as weight_updater.py imports it
import sglang.srt.utils.common as common
print(json.dumps({
    "default": init_custom_process_group(backend="gloo", init_method="tcp://x:1", world_size=2, rank=0,
                                         group_name="g"),
    "explicit": common.init_custom_process_group("gloo", "tcp://x:1", datetime.timedelta(seconds=5)),
    "chained": __import__("os").environ.get("CHAINED"),
}))
"""


def fake_sglang(root: Path) -> Path:
    package = root / "sglang" / "srt" / "utils"
    package.mkdir(parents=True)
    for folder in (root / "sglang", root / "sglang" / "srt"):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from sglang.srt.utils.common import *\n")
    (package / "common.py").write_text(FAKE_COMMON)
    return root


def run_probe(tmp_path: Path, timeout_s: str | None) -> dict:
    """The probe with SGLang's packages and an image's own sitecustomize on the path; with a timeout, in the
    environment the planner gives SGLang engines."""
    other_site = tmp_path / "image_site"
    other_site.mkdir()
    (other_site / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", WEIGHT_SYNC_TIMEOUT_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(fake_sglang(tmp_path / "pkgs")), str(other_site)])
    if timeout_s is not None:
        env = sglang_env(compose("dapo_math", [f"sync.timeout_s={timeout_s}"]), env)
        env[WEIGHT_SYNC_TIMEOUT_ENV] = timeout_s  # what build_local_plan sets for every engine
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_planner_env_gives_the_weight_group_the_recipe_timeout(tmp_path: Path) -> None:
    cfg = compose("dapo_math", ["sync.timeout_s=321"])
    env = sglang_env(cfg, {"PYTHONPATH": "/somewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SGLANG_SITE), "/somewhere"]
    out = run_probe(tmp_path, "321")
    assert out["default"] == {"timeout": 321.0, "group_name": "g"}
    assert out["explicit"]["timeout"] == 5.0  # a timeout SGLang passes itself is kept
    assert out["chained"] == "yes"  # an image's own sitecustomize still runs


def test_without_the_hook_sglang_waits_its_own_default(tmp_path: Path) -> None:
    out = run_probe(tmp_path, None)
    assert out["default"]["timeout"] is None
