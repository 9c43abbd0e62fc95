"""The in-process SGLang test double (tests/sglang_double.py) for the engine client's tests."""

from sglang_double import app, client_for, new_app  # noqa: F401  (fixtures)
