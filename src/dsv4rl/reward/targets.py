"""Where a reward function lives (`target`), how it is loaded, and whether its signature fits.

A target is `builtin:<grader>` (the rule graders and math-verify), `pkg.module:function` (importable from
the working directory or PYTHONPATH), or `path/to/file.py:function` (relative to the recipe's directory,
else to the working directory). Files are loaded under a module name made from their absolute path, so the
trainer and every reward worker process load the same module the same way (`load_function`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4rl.config.schema import GraderName

BUILTIN = "builtin:"
_MODULE_TARGET = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*")
_FILE_TARGET = re.compile(r"(.+\.py):([A-Za-z_]\w*)")
FORM = "builtin:<grader>, pkg.module:function or path/to/file.py:function"


class TargetError(ValueError):
    """A target that cannot be loaded or called as documented; the message names the fix."""


@dataclass(frozen=True)
class Target:
    """A parsed target: `kind` is "builtin", "module" or "file"; `ref` the grader name, the module name or
    the file's absolute path; `function` the function's name (the grader's for a builtin)."""

    kind: str
    ref: str
    function: str
    spec: str  # as the recipe wrote it

    def __str__(self) -> str:
        return self.spec


def looks_like_target(text: str) -> bool:
    """Whether `text` has a target's form (a judge's `parse` is a target or a regex)."""
    return text.startswith(BUILTIN) or bool(_MODULE_TARGET.fullmatch(text) or _FILE_TARGET.fullmatch(text))


def parse_target(spec: str, base_dirs: list[Path]) -> Target:
    """`spec` as a `Target`; a file is looked for in each of `base_dirs` in turn (the recipe's directory,
    then the working directory) unless absolute. Raises TargetError naming the fix."""
    spec = spec.strip()
    if spec.startswith(BUILTIN):
        name = spec.removeprefix(BUILTIN)
        if name not in list(GraderName):
            raise TargetError(
                f"target {spec!r}: no builtin grader {name!r}; choose one of "
                f"{', '.join(BUILTIN + g for g in GraderName)}"
            )
        return Target("builtin", name, name, spec)
    file_match = _FILE_TARGET.fullmatch(spec)
    if file_match:
        path_text, function = file_match.groups()
        path = Path(path_text).expanduser()
        candidates = [path] if path.is_absolute() else [base / path for base in base_dirs]
        for candidate in candidates:
            if candidate.is_file():
                return Target("file", str(candidate.resolve()), function, spec)
        looked = " and ".join(str(c) for c in candidates)
        raise TargetError(
            f"target {spec!r}: file {path_text!r} not found (looked for {looked}); give its path relative to "
            "the recipe's directory or the working directory, or an absolute one"
        )
    if _MODULE_TARGET.fullmatch(spec):
        module, function = spec.split(":")
        return Target("module", module, function, spec)
    raise TargetError(f"target {spec!r} is not of the form {FORM}")


def _file_module_name(path: str) -> str:
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", Path(path).stem)
    return f"dsv4rl_user_{stem}_{digest}"


def load_module(target: Target) -> Any:
    """The module of a module or file target (imported once per process)."""
    if target.kind == "module":
        try:
            return importlib.import_module(target.ref)
        except ModuleNotFoundError as error:
            if error.name is not None and target.ref.startswith(error.name):
                raise TargetError(
                    f"target {target.spec!r}: no module {error.name!r} on the Python path (working directory "
                    f"{Path.cwd()}); check the spelling, run from the directory that holds it, add it to "
                    "PYTHONPATH, or give the file: path/to/file.py:function"
                ) from None
            raise TargetError(f"target {target.spec!r}: importing {target.ref} failed: {error!r}") from error
        except Exception as error:
            raise TargetError(f"target {target.spec!r}: importing {target.ref} raised {error!r}") from error
    name = _file_module_name(target.ref)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, target.ref)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise TargetError(f"target {target.spec!r}: running {target.ref} raised {error!r}") from error
    return module


def load_function(target: Target) -> Callable[..., Any]:
    """The function a module or file target names."""
    module = load_module(target)
    function = getattr(module, target.function, None)
    if function is None or not callable(function):
        defined = sorted(
            name
            for name, value in vars(module).items()
            if inspect.isfunction(value) and not name.startswith("_")
        )
        close = ", ".join(defined) or "none"
        raise TargetError(
            f"target {target.spec!r}: {target.ref} has no function {target.function!r} (its functions: "
            f"{close}); fix the name after the colon"
        )
    return function


def is_async(function: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004  (an instance with an async __call__)
    )


def signature_problem(function: Callable[..., Any], kwargs: dict[str, Any], group: bool) -> str | None:
    """Why `function(sample, **kwargs)` (a group function: `function(samples, **kwargs)`) cannot be called
    as documented, or None."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a builtin or C function: nothing to check
    first = "samples: list[RewardInput]" if group else "sample: RewardInput"
    named = "".join(f", {key}=..." for key in kwargs)
    try:
        signature.bind(object(), **kwargs)
    except TypeError as error:
        name = getattr(function, "__name__", "f")
        return (
            f"{name}{signature} cannot be called as {name}({first.split(':')[0]}{named}) ({error}); define "
            f"it as `def {name}({first}, **kwargs)`" + (" (group: true)" if group else "")
        )
    return None
