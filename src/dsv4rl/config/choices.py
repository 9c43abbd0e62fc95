"""The base of every fixed set of choices in a recipe or on the command line (`dsv4rl.config.schema`,
`dsv4rl.config.sglang_choices`), and the one way to turn an outside value into one."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar


class Choice(StrEnum):
    """A fixed set of choices of the schema. A member prints as its value, in messages too (`{x!r}`
    gives 'aime24', as the recipe spells it)."""

    def __repr__(self) -> str:
        return repr(self.value)


E = TypeVar("E", bound=StrEnum)


def choice(kind: type[E], value: object, key: str) -> E:
    """`value` as one of `kind`'s members, or a ValueError naming `key` and the choices. Code that takes a
    setting from outside a composed recipe (an argument, a request) turns it into the schema's enum here."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is unknown; choose one of {', '.join(kind)}") from None
