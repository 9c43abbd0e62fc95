"""What dsv4rl relies on from SGLang, read from the released wheel, and the checks against it.

`python -m dsv4rl.engine.sglang_contract WHEEL [-o FILE]` reads the wheel's source (never imports or
installs it) and writes `sglang_contract.json` next to this module:

- `routes`: every literal route of `srt/entrypoints/http_server.py` with its HTTP methods, its auth level
  (`@auth_level`), its body struct and its query parameters;
- `bodies`: the fields of the request structs (`srt/managers/io_struct.py`, bases included) with their
  types, defaults and whether they are required;
- `generate_request` and `sampling_params`: the fields of the `/generate` contract gate
  (`sglang/api/v1/api_types.py`; unknown sampling keys are rejected there);
- `chat_completion_request`: the fields of `/v1/chat/completions` (`ChatCompletionRequest` of
  `srt/entrypoints/openai/protocol.py`), what a judge sends and the reference engine reads;
- `server_flags`: every command-line flag of `sglang.launch_server` (`srt/arg_groups/fields/*.py` plus
  the flags `srt/server_args.py` registers by hand) with its destination, type, default and action, and its
  choices when a literal list or a list of `srt/arg_groups/choices.py` gives them (plugins may extend
  those lists at run time: the contract holds the released ones);
- `requires`: the wheel's pinned dependencies (torch, transformers, ...).

`make sglang-contract` downloads the wheel (`pip download --no-deps`) and regenerates the file; the
tests (tests/engine/test_sglang_contract.py) check every request the client sends, every flag the
planner emits and every route and sampling key of the reference engine against it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

CONTRACT_FILE = Path(__file__).with_name("sglang_contract.json")
_SRT = "sglang/srt/"
_HTTP_SERVER = _SRT + "entrypoints/http_server.py"
_IO_STRUCT = _SRT + "managers/io_struct.py"
_API_TYPES = "sglang/api/v1/api_types.py"
_OPENAI_PROTOCOL = _SRT + "entrypoints/openai/protocol.py"
# routes whose body the handler reads itself (no io_struct body): the contract section holding its fields
ROUTE_BODY_SECTIONS = {"/v1/chat/completions": "chat_completion_request"}
_FIELDS_DIR = _SRT + "arg_groups/fields/"
_CHOICES = _SRT + "arg_groups/choices.py"
_SERVER_ARGS = _SRT + "server_args.py"
_ROUTE_METHODS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"], "delete": ["DELETE"], "patch": ["PATCH"]}
_NOT_QUERY = {"request", "raw_request", "obj", "background_tasks"}


# ------------------------------------------------------------------------------------------- extraction
def _literal(node: ast.AST | None) -> Any:
    try:
        return None if node is None else ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def _class_fields(classes: dict[str, ast.ClassDef], name: str) -> dict[str, dict]:
    """Annotated fields of `name` and its bases in the same file (bases first, as Python orders them)."""
    node = classes[name]
    fields: dict[str, dict] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(_class_fields(classes, base.id))
    for statement in node.body:
        if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
            continue
        field = statement.target.id
        if field.startswith("_") or ast.unparse(statement.annotation).startswith("ClassVar"):
            continue
        entry: dict[str, Any] = {
            "type": ast.unparse(statement.annotation),
            "required": statement.value is None,
        }
        if statement.value is not None:
            entry["default"] = _default(statement.value)
        fields[field] = entry
    return fields


def _default(value: ast.AST) -> Any:
    """A literal default, or the text of an expression (`field(default_factory=list)` -> its text)."""
    if isinstance(value, ast.Call):
        for keyword in value.keywords:
            if keyword.arg == "default":
                return _literal(keyword.value)
        return ast.unparse(value)
    return _literal(value)


def _classes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}


def _body_class(
    function: ast.AsyncFunctionDef | ast.FunctionDef, known: dict[str, ast.ClassDef]
) -> str | None:
    for arg in function.args.args:
        annotation = arg.annotation
        # Annotated[X, Body()], Annotated[Optional[X], Body()], Optional[X]
        while isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in (
            "Annotated",
            "Optional",
        ):
            inner = annotation.slice
            annotation = inner.elts[0] if isinstance(inner, ast.Tuple) else inner
        if isinstance(annotation, ast.Name) and annotation.id in known:
            return annotation.id
    return None


def _query_params(function: ast.AsyncFunctionDef | ast.FunctionDef, body: str | None) -> dict[str, str]:
    params = {}
    for arg in function.args.args:
        if arg.arg in _NOT_QUERY or arg.annotation is None:
            continue
        text = ast.unparse(arg.annotation)
        if body is not None and body in text:
            continue
        if text in ("Request", "Response") or text.startswith("Annotated"):
            continue
        params[arg.arg] = text
    return params


def extract_routes(http_server: str, request_classes: dict[str, ast.ClassDef]) -> dict[str, dict]:
    routes: dict[str, dict] = {}
    for node in ast.walk(ast.parse(http_server)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        auth = "normal"
        paths: list[tuple[str, list[str]]] = []
        for decorator in node.decorator_list:
            if not isinstance(decorator, ast.Call):
                continue
            target = ast.unparse(decorator.func)
            if target == "auth_level" and decorator.args:
                auth = ast.unparse(decorator.args[0]).rsplit(".", 1)[-1].lower()
                continue
            if not target.startswith("app.") or not decorator.args:
                continue
            path = decorator.args[0]
            if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
                continue  # routes named by environment variables
            kind = target.removeprefix("app.")
            if kind == "api_route":
                methods = next((_literal(k.value) for k in decorator.keywords if k.arg == "methods"), ["GET"])
            else:
                methods = _ROUTE_METHODS.get(kind)
            if methods:
                paths.append((path.value, sorted(methods)))
        body = _body_class(node, request_classes)
        for path, methods in paths:
            routes[path] = {
                "methods": methods,
                "auth": auth,
                "body": body,
                "query": _query_params(node, body),
                "handler": node.name,
            }
    return dict(sorted(routes.items()))


def _flag_value_type(annotation: str) -> str:
    text = annotation.replace("typing.", "").strip()
    match = re.fullmatch(r"Optional\[(.*)\]", text)
    if match:
        text = match.group(1)
    if text.startswith(("List[", "list[", "Tuple[", "tuple[")):
        return "list"
    if text.startswith("Literal["):
        return "str"
    return {"int": "int", "float": "float", "str": "str", "bool": "bool"}.get(text, "str")


def _arg_meta(node: ast.AST, named_lists: dict[str, list]) -> dict[str, Any]:
    if isinstance(node, ast.Constant):
        return {}
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "Arg":
        meta = {k.arg: _literal(k.value) for k in node.keywords if k.arg}
        choices = next((k.value for k in node.keywords if k.arg == "choices"), None)
        if isinstance(choices, ast.Name) and choices.id in named_lists:
            meta["choices"] = list(named_lists[choices.id])
        return meta
    return {}


def named_lists(source: str) -> dict[str, list]:
    """Module-level `NAME = [literal, ...]` lists of a source (SGLang's choice lists)."""
    lists = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, list):
                lists[node.targets[0].id] = value
    return lists


def extract_field_flags(
    sources: dict[str, str], choice_lists: dict[str, list] | None = None
) -> dict[str, dict]:
    """Flags derived from `A[type, help | Arg(...)]` fields (SGLang's arg_utils rules); `choice_lists`
    resolves `choices=NAME` (`named_lists` of `srt/arg_groups/choices.py`)."""
    choice_lists = choice_lists or {}
    flags: dict[str, dict] = {}
    for _, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            annotation = node.annotation
            if not (
                isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("A", "Annotated")
            ):
                continue
            parts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
            if len(parts) < 2:
                continue
            meta = _arg_meta(parts[1], choice_lists)
            if meta.get("no_cli"):
                continue
            name = node.target.id
            type_text = ast.unparse(parts[0])
            value_type = _flag_value_type(type_text)
            action = meta.get("action")
            if action is None:
                action = "store_true" if value_type == "bool" else "store"
            elif not isinstance(action, str):
                action = str(action)
            cli = meta.get("cli_name") or "--" + name.replace("_", "-")
            entry = {
                "dest": name,
                "type": type_text,
                "value_type": "none" if action == "store_true" else value_type,
                "action": action,
                "default": _default(node.value) if node.value is not None else None,
                "aliases": list(meta.get("aliases") or []),
            }
            if isinstance(meta.get("choices"), list):
                entry["choices"] = meta["choices"]
            if meta.get("nargs"):
                entry["nargs"] = meta["nargs"]
            flags[cli] = entry
    return flags


def extract_manual_flags(server_args: str) -> dict[str, dict]:
    """`parser.add_argument("--x", ...)` calls that server_args.py makes itself (--config, deprecated)."""
    flags: dict[str, dict] = {}
    for node in ast.walk(ast.parse(server_args)):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("add_argument")):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if not names or not names[0].startswith("--"):
            continue
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        action = _literal(keywords.get("action")) if "action" in keywords else "store"
        action = action if isinstance(action, str) else "custom"
        type_text = ast.unparse(keywords["type"]) if "type" in keywords else "str"
        flags[names[0]] = {
            "dest": _literal(keywords.get("dest")) or names[0][2:].replace("-", "_"),
            "type": type_text,
            "value_type": "none" if action.startswith("store_") else _flag_value_type(type_text),
            "action": action,
            "default": _literal(keywords.get("default")),
            "aliases": names[1:],
        }
    return flags


def _requires(metadata: str) -> dict[str, str]:
    pins = {}
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:") or ";" in line:  # extras and markers: not the base install
            continue
        match = re.match(r"Requires-Dist:\s*([A-Za-z0-9_.\-]+)\s*(.*)", line)
        if match:
            pins[match.group(1).lower()] = match.group(2).strip().strip("()")
    return dict(sorted(pins.items()))


def extract_contract(wheel: Path) -> dict[str, Any]:
    """The contract of one SGLang wheel (read as a zip; nothing is imported)."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()

        def read(name: str) -> str:
            return archive.read(name).decode()

        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = read(metadata_name)
        version = re.search(r"^Version:\s*(\S+)", metadata, re.M).group(1)
        io_classes = _classes(read(_IO_STRUCT))
        api_classes = _classes(read(_API_TYPES))
        openai_classes = _classes(read(_OPENAI_PROTOCOL)) if _OPENAI_PROTOCOL in names else {}
        chat_fields = (
            _class_fields(openai_classes, "ChatCompletionRequest")
            if "ChatCompletionRequest" in openai_classes
            else {}
        )
        routes = extract_routes(read(_HTTP_SERVER), io_classes)
        bodies = {
            body: _class_fields(io_classes, body)
            for body in sorted({r["body"] for r in routes.values() if r["body"]})
        }
        field_sources = {n: read(n) for n in names if n.startswith(_FIELDS_DIR) and n.endswith(".py")}
        choice_lists = named_lists(read(_CHOICES)) if _CHOICES in names else {}
        flags = {
            **extract_manual_flags(read(_SERVER_ARGS)),
            **extract_field_flags(field_sources, choice_lists),
        }
    return {
        "sglang": version,
        "wheel": Path(wheel).name,
        "requires": _requires(metadata),
        "routes": routes,
        "bodies": bodies,
        "generate_request": _class_fields(api_classes, "GenerateRequest"),
        "sampling_params": _class_fields(api_classes, "SamplingParams"),
        "chat_completion_request": chat_fields,
        "server_flags": dict(sorted(flags.items())),
    }


# ------------------------------------------------------------------------------------------- checks
@functools.lru_cache(maxsize=1)
def load_contract(path: Path = CONTRACT_FILE) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


# /generate keys SGLang takes through io_struct's GenerateReqInput though its api/v1 gate does not list them
# (srt/managers/io_struct.py:264-269; sglang/api/v1/api_types.py:236-281 has only routed_experts_start_len)
GATE_FREE_GENERATE_KEYS = ("return_routed_experts", "return_indexer_topk")


def request_problems(
    contract: dict, method: str, path: str, body: Any = None, query: dict | None = None
) -> list[str]:
    """Why SGLang would not take this request as meant: an unknown route or method, a body key it drops
    (control bodies ignore unknown keys silently), a required field missing, an unknown sampling key."""
    route = contract["routes"].get(path)
    if route is None:
        return [f"{method} {path}: SGLang {contract['sglang']} has no route {path}"]
    problems = []
    if method.upper() not in route["methods"]:
        problems.append(f"{method} {path}: SGLang accepts {route['methods']} there")
    for key in query or {}:
        if key not in route["query"]:
            problems.append(
                f"{method} {path}: unknown query parameter {key!r} (SGLang: {sorted(route['query'])})"
            )
    if not isinstance(body, dict):
        return problems
    if path == "/generate":
        # The api/v1 gate checks its own fields and ignores other keys; FastAPI then builds io_struct's
        # GenerateReqInput, which alone takes return_routed_experts / return_indexer_topk.
        io_struct = contract["bodies"]["GenerateReqInput"]
        fields = {k: io_struct[k] for k in GATE_FREE_GENERATE_KEYS if k in io_struct}
        fields.update(contract["generate_request"])
        params = body.get("sampling_params") or {}
        for item in params if isinstance(params, list) else [params]:
            for key in item:
                if key not in contract["sampling_params"]:
                    problems.append(f"POST /generate: sampling key {key!r} is not in SGLang's SamplingParams")
    elif route["body"] is not None:
        fields = contract["bodies"][route["body"]]
    elif path in ROUTE_BODY_SECTIONS:
        fields = contract.get(ROUTE_BODY_SECTIONS[path], {})
    else:
        fields = {}
    for key in body:
        if key not in fields:
            problems.append(
                f"{method} {path}: field {key!r} is not in {route['body'] or 'the body'} (dropped)"
            )
    for key, spec in fields.items():
        if spec["required"] and key not in body:
            problems.append(f"{method} {path}: required field {key!r} missing")
    return problems


BOOLEAN_OPTIONAL = "argparse.BooleanOptionalAction"  # `--flag` and `--no-flag`, neither takes a value


def _flag_index(contract: dict) -> dict[str, dict]:
    index = {}
    for name, spec in contract["server_flags"].items():
        for alias in [name, *spec["aliases"]]:
            index[alias] = spec
            if spec.get("action") == BOOLEAN_OPTIONAL and alias.startswith("--"):
                index["--no-" + alias[2:]] = spec
    return index


def _value_matches(value: str, value_type: str) -> bool:
    try:
        if value_type == "int":
            int(value)
        elif value_type == "float":
            float(value)
    except ValueError:
        return False
    return True


def flag_problems(contract: dict, argv: list[str]) -> list[str]:
    """Why `sglang.launch_server` would reject or misread these arguments (argv after the module name)."""
    index = _flag_index(contract)
    problems = []
    i = 0
    while i < len(argv):
        flag = argv[i]
        spec = index.get(flag)
        if spec is None:
            problems.append(f"{flag}: not a flag of SGLang {contract['sglang']}")
            i += 1
            continue
        if spec["value_type"] == "none" or spec.get("action") == BOOLEAN_OPTIONAL:
            i += 1
            continue
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            problems.append(f"{flag}: SGLang expects a {spec['value_type']} value")
            i += 1
            continue
        value = argv[i + 1]
        if not _value_matches(value, spec["value_type"]):
            problems.append(f"{flag} {value}: SGLang parses it as {spec['type']}")
        if "choices" in spec and value not in [str(c) for c in spec["choices"]]:
            problems.append(f"{flag} {value}: SGLang accepts {spec['choices']}")
        i += 2
    return problems


def config_file_problems(contract: dict, data: dict) -> list[str]:
    """Keys of a `--config` YAML file SGLang would not map to a flag: it passes each key on as `--<key>`
    verbatim, so a key is a flag's spelling without the dashes in front (`admin-api-key`, not the dest)."""
    spellings = {
        alias for flag, spec in contract["server_flags"].items() for alias in [flag, *spec["aliases"]]
    }
    return [
        f"--config key {key!r} is not a flag of SGLang {contract['sglang']} (it becomes --{key})"
        for key in data
        if f"--{key}" not in spellings
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dsv4rl.engine.sglang_contract", description=__doc__.split("\n")[0]
    )
    parser.add_argument("wheel", type=Path, help="the SGLang wheel (pip download sglang==X --no-deps)")
    parser.add_argument("-o", "--output", type=Path, default=CONTRACT_FILE)
    args = parser.parse_args(argv)
    contract = extract_contract(args.wheel)
    args.output.write_text(json.dumps(contract, indent=1, sort_keys=False) + "\n")
    print(
        f"{args.output}: SGLang {contract['sglang']}: {len(contract['routes'])} routes, "
        f"{len(contract['bodies'])} request bodies, {len(contract['sampling_params'])} sampling keys, "
        f"{len(contract['server_flags'])} flags",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
