"""Builds ``stdlib_line_order.jsonl``: which ordering of the next line's words is the real one?

Every item is cut from a function of the standard library's *validation* files (the ones
forge's default preparation holds out, ``forge.data.corpus.split_of``), so a model trained on
the embedded corpus has never read them. The context is the function's first lines; the
choices are its real next line and three lines with the same words (names, numbers, operators)
in other orders, in the same places between the same spaces: equal lengths and the same bytes,
so only knowing how Python reads tells them apart (a grammatical minimal set, as in BLiMP).
Run from the repository root:

    python configs/tasks/stdlib_line_order/build.py
"""

from __future__ import annotations

import ast
import json
import pathlib
import random
import re

from forge.data.corpus import split_of, stdlib_files, stdlib_root

HERE = pathlib.Path(__file__).parent
ITEMS = 200
VALIDATION_PERCENT = 2.0  # scripts/prepare_data.py's default --validation-percent


def cuts(path: pathlib.Path, rng: random.Random) -> list[dict[str, str]]:
    """One ``(context, next line)`` cut per function of ``path`` long enough to cut."""
    source = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
            continue
        body = [line for line in lines[node.lineno - 1 : node.end_lineno] if line.strip()]
        if len(body) < 8:
            continue
        at = rng.randrange(3, len(body) - 1)
        if 10 <= len(body[at].strip()) <= 80:
            out.append({"context": "\n".join(body[:at]) + "\n", "line": body[at]})
    return out


WORD = re.compile(r"\w+")  # names, keywords, numbers: the punctuation stays where it is


def reorderings(line: str, rng: random.Random, count: int = 3) -> list[str] | None:
    """``count`` distinct lines with ``line``'s words permuted into its own word slots, or
    None if it has too few words to give that many."""
    words = WORD.findall(line)
    if len(set(words)) < 4:
        return None
    slots = list(WORD.finditer(line))
    found: set[str] = set()
    for _ in range(50):
        order = rng.sample(words, len(words))
        out, end = [], 0
        for match, word in zip(slots, order, strict=True):
            out += [line[end : match.start()], word]
            end = match.end()
        candidate = "".join(out) + line[end:]
        if candidate != line:
            found.add(candidate)
        if len(found) == count:
            return sorted(found)
    return None


def build(seed: int = 0) -> list[dict[str, object]]:
    """The task's items: a context, four orderings of its next line, the index of the real one."""
    root = stdlib_root()
    rng = random.Random(seed)
    pool = [
        c
        for p in stdlib_files(root)
        if split_of(p.relative_to(root).as_posix(), VALIDATION_PERCENT) == "validation"
        for c in cuts(p, rng)
    ]
    rng.shuffle(pool)
    items = []
    for c in pool:
        others = reorderings(c["line"], rng)
        if others is None:
            continue
        choices = [c["line"], *others]
        rng.shuffle(choices)
        items.append(
            {"context": c["context"], "choices": choices, "label": choices.index(c["line"])}
        )
        if len(items) == ITEMS:
            break
    return items


if __name__ == "__main__":
    with open(HERE / "stdlib_line_order.jsonl", "w", encoding="utf-8") as f:
        for item in build():
            f.write(json.dumps(item) + "\n")
