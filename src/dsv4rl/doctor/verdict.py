"""What a check returns: a status, what was found, and the one-line fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum


class Status(StrEnum):
    PASS = "PASS"
    WARN = "WARN"  # the run may start, but slower, less stable, or wrong for other tools
    FAIL = "FAIL"  # the run will not start or will break; `dsv4rl doctor` exits 1
    SKIP = "SKIP"  # not applicable here (no GPU, no recipe, tool not installed)


@dataclass(frozen=True)
class Check:
    """One verdict. `remedy` is empty when there is nothing to do."""

    name: str
    status: Status
    detail: str
    remedy: str = ""

    def to_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}
