"""lm-eval's own task names, kept in forge's cache folder (``forge.harness.tasks``): its index
reads thousands of YAML files, so a start-up that checks a task name, or refuses a misspelt
one, reads the names a process before it listed, as long as lm-eval's task files are the same."""

from __future__ import annotations

import json

import pytest

from forge.harness import tasks as harness_tasks
from forge.harness.tasks import TASKS_CACHE, cached_names, tasks_fingerprint

pytest.importorskip("lm_eval")

# (case, the cache file's text, or None: no file; the names read for key "k", or None)
CACHE_FILES = [
    ("no file", None, None),
    ("the key's names", json.dumps({"key": "k", "names": ["a", "b"]}), {"a", "b"}),
    ("another key's", json.dumps({"key": "other", "names": ["a"]}), None),
    ("not JSON", "{", None),
    ("no names", json.dumps({"key": "k"}), None),
    ("names that are no strings", json.dumps({"key": "k", "names": [1]}), None),
    ("not an object", json.dumps(["a"]), None),
]


@pytest.mark.parametrize(
    "text,names", [c[1:] for c in CACHE_FILES], ids=[c[0] for c in CACHE_FILES]
)
def test_a_cache_file_gives_names_only_for_its_own_key(tmp_path, text, names):
    path = tmp_path / TASKS_CACHE
    if text is not None:
        path.write_text(text)
    read = cached_names(path, "k")
    assert (None if read is None else set(read)) == names


class Index:
    """lm-eval's ``TaskManager`` as the cache sees it: how often the index was built."""

    built = 0

    def __init__(self, **_: object) -> None:
        type(self).built += 1
        self.all_tasks = ["hellaswag", "arc_easy"]


def test_the_index_is_built_once_and_again_when_lm_evals_task_files_change(tmp_path, monkeypatch):
    import lm_eval.tasks

    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Index)
    Index.built = 0
    assert harness_tasks.default_task_names() == {"hellaswag", "arc_easy"}
    assert harness_tasks.default_task_names() == {"hellaswag", "arc_easy"}
    assert Index.built == 1 and (tmp_path / "cache" / TASKS_CACHE).is_file()
    monkeypatch.setattr(harness_tasks, "tasks_fingerprint", lambda folder: "reinstalled")
    harness_tasks.default_task_names()
    assert Index.built == 2


def test_the_fingerprint_follows_the_task_files(tmp_path):
    (tmp_path / "a.yaml").write_text("task: a\n")
    before = tasks_fingerprint(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("task: b\n")
    with_b = tasks_fingerprint(tmp_path)
    assert with_b != before
    (tmp_path / "notes.txt").write_text("not a task file")
    assert tasks_fingerprint(tmp_path) == with_b
