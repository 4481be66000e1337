"""No script destroys what it did not write: ``convert_checkpoint.py export`` / ``import`` and
``prepare_vlm_data.py`` refuse an output folder holding anything else, or lying in a run or a
dataset, replace their own earlier output only with ``--overwrite``, and leave nothing behind
when they refuse."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from forge.outputs import MARKER, OutputKind, output_problem
from tests.e2e.sandbox import Run, copy_trained
from tests.e2e.test_train_script import load_script

CONVERT = load_script("convert_checkpoint")
PREPARE_VLM = load_script("prepare_vlm_data")


def tree(folder: pathlib.Path) -> dict[str, int]:
    """Every file under ``folder`` with its size (links by their target)."""
    return {
        str(p.relative_to(folder)): (p.lstat().st_size if not p.is_symlink() else -1)
        for p in sorted(folder.rglob("*"))
    }


def refused(capsys, code: int, fragment: str) -> None:
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out") and fragment in err[0], err


def no_temporaries(folder: pathlib.Path) -> bool:
    return not [p for p in folder.iterdir() if ".tmp-" in p.name or ".replaced-" in p.name]


# (case, how the target is made (relative to the sandbox root), kind, overwrite, problem or None)
def user_folder(root):
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("my notes")
    return root / "mine"


def own_export(root):
    (root / "exp").mkdir()
    (root / "exp" / MARKER).write_text("hf_export\n")
    (root / "exp" / "model.safetensors").write_bytes(b"x")
    return root / "exp"


def a_file(root):
    (root / "taken").write_text("a file")
    return root / "taken"


def a_run(root):
    (root / "run" / "checkpoints").mkdir(parents=True)
    (root / "run" / "config.toml").write_text("")
    return root / "run"


def a_dataset(root):
    (root / "data").mkdir()
    (root / "data" / "manifest.json").write_text("{}")
    return root / "data"


def unmarked_export(root):
    """An export written before forge marked its outputs, or a user's save_pretrained."""
    (root / "old").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (root / "old" / name).write_text("x")
    return root / "old"


def unmarked_export_with_notes(root):
    (unmarked_export(root) / "notes.txt").write_text("my notes")
    return root / "old"


def unmarked_images(root, extra: str | None = None):
    """An image–caption dataset written before forge marked its outputs."""
    folder = root / "shapes"
    folder.mkdir()
    files = ["train_00000.bin", "train_images.bin", "train_offsets.bin"]
    for name in files + ([extra] if extra else []):
        (folder / name).write_bytes(b"x")
    manifest = {
        "splits": {"train": {"shards": [{"file": "train_00000.bin"}]}},
        "images": {"train": {"file": "train_images.bin", "offsets": "train_offsets.bin"}},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


PROBLEMS = [
    ("a new folder", lambda r: r / "new", OutputKind.HF_EXPORT, False, None),
    ("an empty folder", lambda r: (r / "e").mkdir() or r / "e", OutputKind.HF_EXPORT, False, None),
    ("a user's folder", user_folder, OutputKind.HF_EXPORT, True, "did not write there (notes.txt)"),
    ("its own earlier output", own_export, OutputKind.HF_EXPORT, False, "pass --overwrite"),
    ("its own output, --overwrite", own_export, OutputKind.HF_EXPORT, True, None),
    ("another script's output", own_export, OutputKind.IMPORTED_CHECKPOINT, True, "did not write"),
    ("a file", a_file, OutputKind.HF_EXPORT, True, "a file of that name exists"),
    ("a run directory", a_run, OutputKind.HF_EXPORT, True, "lies in the run or checkpoint"),
    (
        "a run's checkpoints",
        lambda r: a_run(r) / "checkpoints",
        OutputKind.IMPORTED_CHECKPOINT,
        True,
        "lies in the run",
    ),
    ("inside a run", lambda r: a_run(r) / "export2", OutputKind.HF_EXPORT, True, "lies in the run"),
    ("the run's own export folder", lambda r: a_run(r) / "export", OutputKind.HF_EXPORT, False, None),
    ("the run's export folder, for a checkpoint", lambda r: a_run(r) / "export", OutputKind.IMPORTED_CHECKPOINT, True, "lies in the run"),
    ("an unmarked export (or a user's save_pretrained), --overwrite", unmarked_export, OutputKind.HF_EXPORT, True, "did not write there"),
    ("such an export beside a user's file", unmarked_export_with_notes, OutputKind.HF_EXPORT, True, "did not write there"),
    ("an image dataset from before markers, --overwrite", unmarked_images, OutputKind.IMAGE_TEXT_DATASET, True, None),
    ("such a dataset, as an export", unmarked_images, OutputKind.HF_EXPORT, True, "did not write there"),
    ("such a dataset with a file its manifest does not list", lambda r: unmarked_images(r, "notes.txt"), OutputKind.IMAGE_TEXT_DATASET, True, "did not write there"),
    (
        "inside a dataset",
        lambda r: a_dataset(r) / "sub",
        OutputKind.IMAGE_TEXT_DATASET,
        True,
        "inside the dataset",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "kind", "overwrite", "problem"),
    [c[1:] for c in PROBLEMS],
    ids=[c[0] for c in PROBLEMS],
)
def test_which_output_folders_a_script_may_write(tmp_path, make, kind, overwrite, problem):
    said = output_problem(make(tmp_path), kind, overwrite)
    assert (said is None) if problem is None else (said is not None and problem in said), said


def test_export_into_its_own_run_is_refused_and_the_run_is_intact(sandbox: Run, trained, capsys):
    copy_trained(trained, sandbox)
    before = tree(sandbox.dir)
    code = CONVERT.main(["export", str(sandbox.dir), "--out", str(sandbox.dir)])
    refused(capsys, code, "lies in the run or checkpoint directory")
    assert tree(sandbox.dir) == before and no_temporaries(sandbox.root)


def test_export_into_the_runs_own_export_folder_leaves_the_rest_of_the_run(
    sandbox: Run, trained, capsys
):
    copy_trained(trained, sandbox)
    before = tree(sandbox.dir)
    out = sandbox.dir / "export"  # where checkpoint.export_final writes
    assert CONVERT.main(["export", str(sandbox.dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / MARKER).is_file()
    after = tree(sandbox.dir)
    assert {k: v for k, v in after.items() if not k.startswith("export")} == before
    # a second export there replaces only its own, when asked
    assert CONVERT.main(["export", str(sandbox.dir), "--out", str(out)]) == 2
    assert CONVERT.main(["export", str(sandbox.dir), "--out", str(out), "--overwrite"]) == 0
    assert no_temporaries(sandbox.dir)


def test_export_over_a_users_folder_is_refused_and_their_files_stay(sandbox, trained, capsys):
    copy_trained(trained, sandbox)
    mine = user_folder(sandbox.root)
    code = CONVERT.main(["export", str(sandbox.dir), "--out", str(mine), "--overwrite"])
    refused(capsys, code, "holds files forge did not write there (notes.txt)")
    assert tree(mine) == {"notes.txt": 8} and no_temporaries(sandbox.root)


def test_import_into_a_runs_checkpoints_is_refused_and_the_run_still_resumes(
    sandbox, trained, tmp_path, capsys
):
    copy_trained(trained, sandbox)
    exported = tmp_path / "exported"
    assert (
        CONVERT.main(["export", str(sandbox.dir), "--out", str(exported), "--dtype", "float32"])
        == 0
    )
    capsys.readouterr()
    before = tree(sandbox.ckpt)
    code = CONVERT.main(["import", str(exported), "--out", str(sandbox.ckpt)])
    refused(capsys, code, "lies in the run or checkpoint directory")
    assert tree(sandbox.ckpt) == before and os.readlink(sandbox.ckpt / "latest") == "step_10"


def test_a_second_export_needs_overwrite_and_then_replaces_only_its_own(
    sandbox, trained, tmp_path, capsys
):
    copy_trained(trained, sandbox)
    out = tmp_path / "exp"
    args = ["export", str(sandbox.dir), "--out", str(out), "--dtype", "float32"]
    assert CONVERT.main(args) == 0
    assert (out / MARKER).read_text().strip() == "hf_export" and (out / "config.json").is_file()
    capsys.readouterr()
    refused(capsys, CONVERT.main(args), "pass --overwrite")
    first = (out / "model.safetensors").stat().st_mtime_ns
    assert CONVERT.main([*args, "--overwrite"]) == 0
    assert (out / "model.safetensors").stat().st_mtime_ns != first
    assert no_temporaries(tmp_path)
    imported = tmp_path / "imported"
    assert CONVERT.main(["import", str(out), "--out", str(imported)]) == 0
    assert (imported / MARKER).read_text().strip() == "imported_checkpoint"
    assert os.readlink(imported / "latest") == "step_0" and (imported / "step_0").is_dir()
    capsys.readouterr()
    refused(capsys, CONVERT.main(["import", str(out), "--out", str(imported)]), "--overwrite")


def test_prepare_vlm_data_keeps_other_folders_and_replaces_its_own_only_when_asked(
    tmp_path, capsys
):
    mine = user_folder(tmp_path)
    refused(capsys, PREPARE_VLM.main(["--out", str(mine), "--n", "20"]), "did not write")
    assert tree(mine) == {"notes.txt": 8}
    out = tmp_path / "shapes"
    assert PREPARE_VLM.main(["--out", str(out), "--n", "20"]) == 0
    capsys.readouterr()
    refused(capsys, PREPARE_VLM.main(["--out", str(out), "--n", "30"]), "pass --overwrite")
    assert PREPARE_VLM.main(["--out", str(out), "--n", "30", "--overwrite"]) == 0
    assert (out / "manifest.json").is_file() and no_temporaries(tmp_path)
    inside = out / "nested"
    capsys.readouterr()
    refused(capsys, PREPARE_VLM.main(["--out", str(inside), "--n", "20"]), "inside the dataset")


def test_a_failed_rename_puts_the_earlier_output_back(tmp_path, monkeypatch):
    from forge import outputs

    out = own_export(tmp_path)
    tmp = outputs.temporary_sibling(out)
    (tmp / "model.safetensors").write_bytes(b"new")
    real = outputs.os.replace

    def fail_on_the_new_one(src, dst):
        if pathlib.Path(src) == tmp:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", fail_on_the_new_one)
    with pytest.raises(OSError):
        outputs.replace_output(tmp, out, OutputKind.HF_EXPORT)
    assert (out / "model.safetensors").read_bytes() == b"x"  # the earlier export, in place
    assert not [p for p in tmp_path.iterdir() if ".replaced-" in p.name]
