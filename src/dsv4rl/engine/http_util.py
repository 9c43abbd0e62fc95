"""HTTP helpers shared by the engine's routes: control-plane body parsing and SGLang's auth rules."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError


class BadRequest(Exception):
    """A control-plane body that fails validation: 400 in SGLang's OpenAI-style error shape."""


class Body(BaseModel):
    """Control-plane bodies ignore unknown keys (and so accept `rid`)."""

    model_config = ConfigDict(extra="ignore")


class PauseBody(Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


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


# Every weight, pause, flush and abort endpoint: admin key if set, else the api key if set.
ADMIN_PATHS = frozenset(
    {
        "/begin_weight_update", "/end_weight_update", "/init_weights_update_group",
        "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weight_version",
        "/update_weights_from_tensor", "/update_weights_from_disk", "/weights_checker",
        "/get_weights_by_name", "/pause_generation", "/continue_generation", "/abort_request",
        "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
    }
)  # fmt: skip


def check_auth(
    path: str, authorization: str | None, api_key: str | None, admin_key: str | None
) -> int | None:
    """None when allowed, else 401 or 403 (SGLang's `srt/utils/auth.py`)."""
    if path.startswith(("/health", "/ready", "/metrics")):
        return None
    token = None
    if authorization and authorization.startswith("Bearer "):
        token = authorization[len("Bearer ") :]
    if path in ADMIN_PATHS:
        required = admin_key or api_key
        if required is None or token == required:
            return None
        return 403 if token is not None and token == api_key else 401
    if api_key is None or token in (api_key, admin_key):
        return None
    return 401
