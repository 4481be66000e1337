"""The base of every error caused by user input (config, data, checkpoint)."""

from __future__ import annotations

from collections.abc import Sequence


class UserInputError(ValueError):
    """Bad input: each line names the thing (key, file, checkpoint) and the fix. Exit code 2."""

    def __init__(self, lines: str | Sequence[str]) -> None:
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))
