"""``[hooks]``: training hooks named in the config, with keyword arguments per class."""

from __future__ import annotations

import re
from typing import Any

import attrs

from forge.config.ranges import Problem

# "package.module:ClassName"
HOOK_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


@attrs.frozen
class HooksConfig:
    """Classes to instantiate as ``Hooks``, each ``"package.module:ClassName"``; the keyword
    arguments of one come from ``[hooks.args."package.module:ClassName"]``. They are imported
    and their arguments checked when the config is validated."""

    classes: list[str] = attrs.Factory(list)
    args: dict[str, dict[str, Any]] = attrs.Factory(dict)

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        for i, path in enumerate(self.classes):
            if not HOOK_PATH.match(path):
                p.append(
                    (f"hooks.classes[{i}]", f"must be 'package.module:ClassName', got {path!r}")
                )
        if len(set(self.classes)) != len(self.classes):
            p.append(("hooks.classes", "lists a class twice"))
        for path in self.args:
            if path not in self.classes:
                p.append((f'hooks.args."{path}"', "names a class that hooks.classes does not list"))
        return p
