"""A tool that cannot do its job: the service behind it is down, so every call raises
(tests/e2e/test_tools_cpu.py: such a run stops in its first step, naming the tool)."""

from __future__ import annotations


def lookup(query: str = "") -> str:
    """Look the hidden value up.

    Args:
        query: unused.
    """
    raise ConnectionError("the lookup service at 10.0.0.7:8080 is down")
