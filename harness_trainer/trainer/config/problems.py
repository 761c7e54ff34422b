"""The one error a config with bad values raises, naming every problem at once."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigProblems(ValueError):
    """Every problem with a config's values, in one message; ``problems`` lists them one by one."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"invalid {what}: " + "; ".join(self.problems))
