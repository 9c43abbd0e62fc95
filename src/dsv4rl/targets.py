"""Where user and builtin code lives (a recipe's `target`), and loading it: one loader, one set of errors.

Reward functions, tools, rollout environments (and rollout filters) are all named the same way:

- `builtin:<name>`: one of dsv4rl's own, from the caller's table (`builtins`: name -> `pkg.module:attr`);
- `pkg.module:name`: importable from the working directory or PYTHONPATH;
- `path/to/file.py:name`: relative to each of `base_dirs` in turn (the recipe's directory, then the working
  directory), or absolute.

Files are loaded under a module name made from their absolute path, so the trainer and every worker process
load the same module the same way. Every kind of target gets the same errors (`TargetError`), each naming
the fix: a file not found names the nearest files that exist, a name the module lacks names what it
defines, a builtin that is not one names those that are.

This module sits on the bottom floor: it imports nothing of dsv4rl, so every layer can use it.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILTIN = "builtin:"
_MODULE_TARGET = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*")
_FILE_TARGET = re.compile(r"(.+\.py):([A-Za-z_]\w*)")
_PLACEHOLDER = {"function": "function", "class": "Class", "class or function": "Name"}


class TargetError(ValueError):
    """A target that cannot be loaded as documented; the message names the fix."""


@dataclass(frozen=True)
class Target:
    """A parsed target. `kind` is "builtin", "module" or "file"; `ref` the module's name (a builtin's too)
    or the file's absolute path; `attr` the name after the colon; `builtin` a builtin's own name."""

    kind: str
    ref: str
    attr: str
    spec: str  # as the recipe wrote it
    builtin: str = ""

    def __str__(self) -> str:
        return self.spec


def form(what: str = "function", builtin_noun: str = "name") -> str:
    """The forms a target may take, for messages ("builtin:<grader>, pkg.module:function or ...")."""
    name = _PLACEHOLDER.get(what, "name")
    return f"{BUILTIN}<{builtin_noun}>, pkg.module:{name} or path/to/file.py:{name}"


def looks_like_target(text: str) -> bool:
    """Whether `text` has a target's form (a judge's `parse` is a target or a regex)."""
    return text.startswith(BUILTIN) or bool(_MODULE_TARGET.fullmatch(text) or _FILE_TARGET.fullmatch(text))


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _nearest_files(path_text: str, base_dirs: Sequence[Path]) -> list[str]:
    """Python files near where `path_text` was looked for (in the nearest folder that exists and its
    subfolders, one level down; compared below that folder), written as the recipe would write them."""
    path = Path(path_text).expanduser()
    near: dict[str, str] = {}  # below the folder -> as the recipe would write it
    wanted: set[str] = set()
    for base in [Path("/")] if path.is_absolute() else base_dirs:
        folder = base / path.parent
        while not folder.is_dir() and folder != base and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir() or folder == folder.parent:  # not the file system's root: too much there
            continue
        wanted.add(os.path.relpath(base / path, folder))
        for file in sorted([*folder.glob("*.py"), *folder.glob("[!.]*/*.py")]):
            shown = file.as_posix() if path.is_absolute() else os.path.relpath(file, base)
            near.setdefault(os.path.relpath(file, folder), shown)
    scored = sorted(
        ((difflib.SequenceMatcher(None, key, file).ratio(), file) for key in wanted for file in near),
        reverse=True,
    )
    best = scored[0][0] if scored else 1.0
    close = [file for ratio, file in scored if ratio >= max(0.6, best - 0.05)]  # the nearest, and any as near
    return list(dict.fromkeys(near[file] for file in close))[:3]


def parse(
    spec: str,
    base_dirs: Sequence[Path] = (),
    builtins: Mapping[str, str] | None = None,
    *,
    role: str = "target",
    what: str = "function",
    builtin_noun: str = "name",
) -> Target:
    """`spec` as a `Target`, without importing anything. `builtins` maps `builtin:<name>` to `pkg.module:attr`
    (None: this kind of target has no builtins); `role` starts each message ("tool target"), `what` names
    the thing after the colon ("function", "class", "class or function"), `builtin_noun` a builtin ("grader").
    Raises TargetError naming the fix."""
    spec = spec.strip()
    if spec.startswith(BUILTIN):
        name = spec.removeprefix(BUILTIN)
        if not builtins:
            placeholder = _PLACEHOLDER.get(what, "name")
            raise TargetError(
                f"{role} {spec!r}: there is no builtin {builtin_noun}; give "
                f"pkg.module:{placeholder} or path/to/file.py:{placeholder}"
            )
        if name not in builtins:
            close = difflib.get_close_matches(name, list(builtins), n=1, cutoff=0.6)
            hint = f" (did you mean {BUILTIN}{close[0]}?)" if close else ""
            raise TargetError(
                f"{role} {spec!r}: no builtin {builtin_noun} {name!r}{hint}; choose one of "
                f"{', '.join(BUILTIN + b for b in builtins)}"
            )
        module, attr = builtins[name].split(":")
        return Target("builtin", module, attr, spec, name)
    file_match = _FILE_TARGET.fullmatch(spec)
    if file_match:
        path_text, attr = file_match.groups()
        path = Path(path_text).expanduser()
        candidates = [path] if path.is_absolute() else [Path(base) / path for base in base_dirs]
        for candidate in candidates:
            if candidate.is_file():
                return Target("file", str(candidate.resolve()), attr, spec)
        looked = " and ".join(str(c) for c in candidates) or "nowhere: no base directory"
        near = _nearest_files(path_text, [Path(b) for b in base_dirs])
        hint = f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""
        raise TargetError(
            f"{role} {spec!r}: file {path_text!r} not found (looked for {looked}){hint}; give its path "
            "relative to the recipe's directory or the working directory, or an absolute one"
        )
    if _MODULE_TARGET.fullmatch(spec):
        module, attr = spec.split(":")
        return Target("module", module, attr, spec)
    raise TargetError(f"{role} {spec!r} is not of the form {form(what, builtin_noun)}")


def _file_module_name(path: str) -> str:
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", Path(path).stem)
    return f"dsv4rl_user_{stem}_{digest}"


def load_module(target: Target, role: str = "target") -> Any:
    """The module a target names (imported once per process)."""
    if target.kind in ("module", "builtin"):
        try:
            return importlib.import_module(target.ref)
        except ModuleNotFoundError as error:
            if error.name is not None and target.ref.startswith(error.name) and target.kind == "module":
                raise TargetError(
                    f"{role} {target.spec!r}: no module {error.name!r} on the Python path (working directory "
                    f"{Path.cwd()}); check the spelling, run from the directory that holds it, add it to "
                    "PYTHONPATH, or give the file: path/to/file.py:" + target.attr
                ) from None
            raise TargetError(f"{role} {target.spec!r}: importing {target.ref} failed: {error!r}") from error
        except Exception as error:
            raise TargetError(f"{role} {target.spec!r}: importing {target.ref} raised {error!r}") from error
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
        raise TargetError(f"{role} {target.spec!r}: running {target.ref} raised {error!r}") from error
    return module


def _defined(module: Any, what: str) -> list[str]:
    """The public names `module` itself defines of the kind `what` names."""
    kinds: tuple[Callable[[Any], bool], ...] = {
        "function": (inspect.isfunction,),
        "class": (inspect.isclass,),
    }.get(what, (inspect.isfunction, inspect.isclass))
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and any(kind(value) for kind in kinds)
        and getattr(value, "__module__", None) == module.__name__
    )


def resolve(target: Target, *, role: str = "target", what: str = "function") -> Any:
    """What a parsed target names (its module imported); for `what="function"` it must be callable."""
    module = load_module(target, role)
    found = getattr(module, target.attr, None)
    if found is None or (what == "function" and not callable(found)):
        defined = _defined(module, what)
        plural = {"function": "functions", "class": "classes"}.get(what, "classes and functions")
        missing = (
            f"has no {what} {target.attr!r}"
            if found is None
            else (f"has {target.attr!r}, but it is {type(found).__name__} {found!r:.40}, not a {what}")
        )
        raise TargetError(
            f"{role} {target.spec!r}: {target.ref} {missing} (its {plural}: {', '.join(defined) or 'none'}"
            f"{_did_you_mean(target.attr, defined)}); fix the name after the colon"
        )
    return found


def load(
    spec: str, base_dirs: Sequence[Path] = (), builtins: Mapping[str, str] | None = None, **how: str
) -> Any:
    """What `spec` names, loaded: `parse` (`how`: its keywords, role, what and builtin_noun), then `resolve`;
    TargetError naming the fix."""
    target = parse(spec, base_dirs, builtins, **how)
    return resolve(target, role=how.get("role", "target"), what=how.get("what", "function"))


def is_async(function: Callable[..., Any]) -> bool:
    """An `async def` function, or an instance with an async `__call__`."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004
    )


def keyword_problem(function: Callable[..., Any], kwargs: Mapping[str, Any], *, skip: int = 0) -> str | None:
    """The recipe's keyword arguments that `function` does not take, with the nearest names it does, or
    None. A misspelled keyword is the recipe's mistake: the fix is the recipe's spelling, never a `**kwargs`
    in the function that would swallow it. `skip`: leading parameters the caller fills (the sample)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin or C function: nothing to check
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    taken = [p.name for p in parameters[skip:] if p.kind in (*positional[1:], p.KEYWORD_ONLY)]
    unknown = [key for key in kwargs if key not in taken]
    if not unknown:
        return None
    said = "; ".join(f"unknown keyword argument {key!r}{_did_you_mean(key, taken)}" for key in unknown)
    takes = f"it takes {', '.join(taken)}" if taken else "it takes no keyword arguments"
    if any(difflib.get_close_matches(key, taken, n=1, cutoff=0.6) for key in unknown):
        return f"{said} ({takes}): fix the spelling in the recipe's kwargs"
    named = ", ".join(f"{key}=..." for key in unknown)
    return f"{said} ({takes}): drop it from the recipe's kwargs, or give it a parameter ({named})"
