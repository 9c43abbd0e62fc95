"""The sink every rule reports its problems to.

Lives apart from `validate` so the rule modules can import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable

Add = Callable[[str], None]
