"""The task's documents: the JSONL beside this file, read without the network."""

import json
import pathlib

import datasets

ITEMS = pathlib.Path(__file__).with_name("stdlib_line_order.jsonl")


def load(**_: object) -> dict[str, datasets.Dataset]:
    """The one split, ``test``, of ``stdlib_line_order.jsonl``."""
    rows = [json.loads(line) for line in ITEMS.read_text(encoding="utf-8").splitlines()]
    return {"test": datasets.Dataset.from_list(rows)}
