"""The import layers of `src/dsv4rl` (docs/architecture.md): each package imports only the ones below it,
config/ imports nothing of dsv4rl, and no two files import each other (type-only imports aside).

Read from the source with `ast` (function-level imports included), so a new upward import fails here
with the two files named, before it becomes a cycle someone has to untangle."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom first; a package may import only packages listed before it (siblings on one line: neither
# imports the other).
LAYERS = [
    ["config", "targets", "aio"],
    ["metrics", "faults", "quant", "topology", "samples"],
    ["wire", "model", "algo", "reward", "data", "estimate", "report"],
    ["engine", "engine_client", "tools"],
    ["sync", "rollout", "trackers"],
    ["eval"],
    ["train"],
    ["checks", "export"],
    ["launcher"],
    ["doctor"],
    ["cli"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "dsv4rl").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The dsv4rl modules `name` imports at run time (imports under `if TYPE_CHECKING:` left out)."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target not in (name, "dsv4rl"):
                found.add(target)
    return found


def _package(module: str) -> str:
    return module.split(".")[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items() if name != "dsv4rl"}


def test_every_package_has_a_layer() -> None:
    placed = {package for layer in LAYERS for package in layer}
    packages = {_package(name) for name in _graph()}
    assert packages == placed, (
        f"packages without a layer: {packages - placed}; layers naming none: {placed - packages}"
    )


def test_imports_run_down_the_layers() -> None:
    level = {package: index for index, layer in enumerate(LAYERS) for package in layer}
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in _graph().items()
        for target in targets
        if _package(source) != _package(target) and level[_package(target)] >= level[_package(source)]
    )
    assert not upward, "imports that do not run down a layer:\n" + "\n".join(upward)


def test_config_imports_no_other_dsv4rl_package() -> None:
    graph = _graph()
    outside = sorted(f"{s} -> {t}" for s, ts in graph.items() if _package(s) == "config" for t in ts
                     if _package(t) != "config")  # fmt: skip
    assert not outside


def test_no_two_files_import_each_other() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"files that import each other: {cycles}"
