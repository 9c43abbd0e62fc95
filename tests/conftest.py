"""Session-wide settings: one tiny-model cache for the whole session, not the user's ~/.cache.

The end-to-end runs start `dsv4rl` as subprocesses; they inherit the variable, so after the first build
every run copies the model instead of importing transformers to build it (dsv4rl.model.model_dir)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from _pytest.nodes import Node

from dsv4rl.model.model_dir import CACHE_ENV

# On pytest-xdist workers (`make test`, `make test-fast`; --dist loadgroup): a test file is one unit of work,
# so its module fixtures are built once; files that share a session fixture are one unit
# (SHARED_FIXTURE_GROUPS), and the end-to-end files are handed out first, so that the longest units do not
# start last. Every file with a `slow` test is one unit, SERIAL: the end-to-end runs each keep one to two
# cores busy with OpenMP threads that spin while another process wants the cores, so two of them at once
# on CI's 2 cores ran over twice as slow; one worker runs them one after another while the others take the
# single-threaded unit tests beside them. (Passive waiting, OMP_WAIT_POLICY=PASSIVE, made the whole run
# slower: docs/verification.md.)
SHARED_FIXTURE_GROUPS = {
    "tests/e2e/test_train_cpu.py": "trained_arith",  # trained_arith and short_arith (tests/e2e/conftest.py)
    "tests/e2e/test_two_nodes_cpu.py": "trained_arith",
}
SERIAL = "slow_serial"
FIRST = ("tests/docs/", "tests/e2e/")

_made: list[str] = []


def pytest_configure(config) -> None:
    if CACHE_ENV not in os.environ:
        _made.append(tempfile.mkdtemp(prefix="dsv4rl-test-cache-"))
        os.environ[CACHE_ENV] = _made[0]
    grouped = config.getoption("dist", "no") == "loadgroup" and config.getoption("numprocesses", None)
    if grouped and not _test_ids_take_groups():
        raise pytest.UsageError(
            f"pytest {pytest.__version__} keeps test ids where pytest-xdist's --dist loadgroup cannot tag "
            "them with their group (pytest-xdist issue 1386): the groups would be ignored without a word "
            "and two end-to-end runs would share the cores. Install the pytest that pyproject.toml's dev "
            "extra names (`make install`), or run in one process (TEST_WORKERS=0)"
        )


def _test_ids_take_groups() -> bool:
    """Whether a test's id follows its `_nodeid`, where xdist's loadgroup writes `<id>@<group>`."""
    probe = object.__new__(Node)
    probe._nodeid = "tests/test_x.py::test_x@group"
    try:
        return probe.nodeid == "tests/test_x.py::test_x@group"
    except AttributeError:  # pytest 9.2: the id is a structured object of its own
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    if not config.getoption("loadgroup", default=False):
        return

    def path(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    # SGLang's interpreter workers (sglang_sides) start once per session and process
    sglang_files = {path(item) for item in items if "sglang_sides" in item.fixturenames}
    # A file is serial only where its slow tests run: under `-m "not slow"` (make test-fast) its other
    # tests are spread over the workers like any unit test's.
    selected = _mark_filter(config)
    slow_files = {path(item) for item in items if item.get_closest_marker("slow") and selected(item)}
    for item in items:
        file = path(item)
        if file in slow_files:
            group = SERIAL
        elif file in sglang_files:
            group = "sglang_sides"
        else:
            group = SHARED_FIXTURE_GROUPS.get(file, file)
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: (path(item) not in slow_files, not item.nodeid.startswith(FIRST)))


def _mark_filter(config):
    """Whether `-m` keeps an item (pytest deselects after this hook, by the same expression)."""
    from _pytest.mark.expression import Expression

    expression = config.getoption("markexpr", default="")
    if not expression:
        return lambda item: True
    compiled = Expression.compile(expression)
    return lambda item: compiled.evaluate(lambda name, **_: item.get_closest_marker(name) is not None)


def pytest_unconfigure(config) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def sglang_sides():
    """SGLang 0.5.23's interpreter for the `sglang` group (tests/sglang_runner.py): `sglang_sides.get(env)`
    is a worker started with those environment variables, shared by the session."""
    from sglang_runner import SGLangSides

    sides = SGLangSides()
    yield sides
    sides.close()
