"""lm-eval's own task names, kept in forge's cache folder (``forge.harness.tasks``): its index
reads thousands of YAML files, so a start-up that checks a task name, or refuses a misspelt
one, reads the names a process before it listed, as long as lm-eval's task files are the same."""

from __future__ import annotations

import json

import pytest

from forge.harness import tasks as harness_tasks
from forge.harness.tasks import CACHED_INSTALLS, TASKS_CACHE, cached_entries, tasks_fingerprint

# (case, the cache file's text, or None: no file; the entries read)
CACHE_FILES = [
    ("no file", None, {}),
    ("entries", json.dumps({"entries": {"k": ["a", "b"], "j": []}}), {"k": ["a", "b"], "j": []}),
    ("not JSON", "{", {}),
    ("no entries", json.dumps({"k": ["a"]}), {}),
    ("names that are no strings", json.dumps({"entries": {"k": [1], "j": ["a"]}}), {"j": ["a"]}),
    ("not an object", json.dumps(["a"]), {}),
]


@pytest.mark.parametrize(
    "text,entries", [c[1:] for c in CACHE_FILES], ids=[c[0] for c in CACHE_FILES]
)
def test_a_cache_file_gives_its_valid_entries_only(tmp_path, text, entries):
    path = tmp_path / TASKS_CACHE
    if text is not None:
        path.write_text(text)
    assert cached_entries(path) == entries


class Index:
    """lm-eval's ``TaskManager`` as the cache sees it: how often the index was built."""

    built = 0

    def __init__(self, **_: object) -> None:
        type(self).built += 1
        self.all_tasks = ["hellaswag", "arc_easy"]


def names_in_a_fresh_process() -> frozenset[str]:
    harness_tasks.lm_eval_index.cache_clear()  # a process's own index is built once
    return harness_tasks.default_task_names()


def test_the_index_is_built_once_per_install_of_lm_eval(tmp_path, monkeypatch):
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(lm_eval_tasks, "TaskManager", Index)
    Index.built = 0
    assert names_in_a_fresh_process() == {"hellaswag", "arc_easy"}
    assert names_in_a_fresh_process() == {"hellaswag", "arc_easy"}
    assert Index.built == 1 and (tmp_path / "cache" / TASKS_CACHE).is_file()
    for install in range(CACHED_INSTALLS + 1):  # other installs: the latest ones are kept
        monkeypatch.setattr(harness_tasks, "tasks_fingerprint", lambda _, i=install: f"i{i}")
        names_in_a_fresh_process()
    assert Index.built == 2 + CACHED_INSTALLS
    assert len(cached_entries(tmp_path / "cache" / TASKS_CACHE)) == CACHED_INSTALLS
    names_in_a_fresh_process()  # the latest install's names: read
    assert Index.built == 2 + CACHED_INSTALLS
    monkeypatch.setattr(harness_tasks, "tasks_fingerprint", lambda _: None)  # unreadable files
    names_in_a_fresh_process()
    assert Index.built == 3 + CACHED_INSTALLS
    harness_tasks.lm_eval_index.cache_clear()


def test_the_fingerprint_follows_the_task_files(tmp_path):
    (tmp_path / "a.yaml").write_text("task: a\n")
    before = tasks_fingerprint(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("task: b\n")
    with_b = tasks_fingerprint(tmp_path)
    assert with_b != before
    (tmp_path / "notes.txt").write_text("not a task file")
    assert tasks_fingerprint(tmp_path) == with_b
