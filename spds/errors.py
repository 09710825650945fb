"""The one exception spds raises for what a user can act on."""

from __future__ import annotations


class SpdsError(Exception):
    """An error the user can act on; the CLI prints it without a traceback and exits non-zero."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []

    def __str__(self) -> str:
        if not self.problems:
            return super().__str__()
        return super().__str__() + "\n" + "\n".join(f"  - {p}" for p in self.problems)
