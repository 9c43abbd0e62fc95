"""HTTP helpers shared by the engine's routes: control-plane body parsing and SGLang's auth rules."""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from dsv4rl.config.sglang_choices import PauseMode


class BadRequest(Exception):
    """A control-plane body that fails validation: 400 in SGLang's OpenAI-style error shape."""


class Body(BaseModel):
    """Control-plane bodies ignore unknown keys (and so accept `rid`)."""

    model_config = ConfigDict(extra="ignore")


class PauseBody(Body):
    mode: PauseMode = PauseMode.abort


class AbortBody(Body):
    rid: str = ""
    abort_all: bool = False


async def read_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
        return model.model_validate(data)
    except (ValidationError, ValueError) as error:
        raise BadRequest(str(error)) from error


# Every weight, pause, flush and abort endpoint (SGLang's `@auth_level(ADMIN_OPTIONAL)`, checked against
# its released code by tests/engine/test_sglang_contract.py).
ADMIN_PATHS = frozenset(
    {
        "/begin_weight_update", "/end_weight_update", "/init_weights_update_group",
        "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weight_version",
        "/update_weights_from_tensor", "/update_weights_from_disk", "/weights_checker",
        "/get_weights_by_name", "/pause_generation", "/continue_generation", "/abort_request",
        "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation", "/freeze_gc",
    }
)  # fmt: skip


def _bearer_matches(authorization: str | None, expected: str) -> bool:
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], expected)


def check_auth(
    path: str, authorization: str | None, api_key: str | None, admin_key: str | None, method: str = "POST"
) -> int | None:
    """None when allowed, else 401 (SGLang's `srt/utils/auth.py::decide_request_auth`).

    Admin routes: the admin key when set (the api key is then not accepted), else the api key when set,
    else open. Other routes: the api key when set (the admin key does not open them), else open.
    """
    if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return None
    required = (admin_key or api_key) if path in ADMIN_PATHS else api_key
    if not required or _bearer_matches(authorization, required):
        return None
    return 401
