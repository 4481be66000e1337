"""scripts/prepare_data.py: formats, tokenizers, parallel = serial, resume, refusing overwrites."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import forge.data.prepare as prep
from forge.data.shards import open_split, read_manifest
from tests.conftest import REPO
from tests.e2e.test_train_script import load_script

PREPARE = load_script("prepare_data")


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def texts(n=200):
    return [f"document {i}: " + "lorem ipsum " * (i % 17 + 1) for i in range(n)]


def decoded_documents(folder, split="train"):
    """The dataset's documents as bytes (byte tokenizer: BOS ... EOS framing)."""
    m = read_manifest(folder)
    tokens = np.concatenate(open_split(folder, m, split, verify=True))
    starts = np.flatnonzero(tokens == 256)
    return [bytes(tokens[s + 1 : e - 1].astype(np.uint8)) for s, e in
            zip(starts, [*starts[1:], len(tokens)], strict=True)]  # fmt: skip


def test_jsonl_field_becomes_one_document_per_line(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", texts(), field="body")
    out = tmp_path / "out"
    args = ["--input", str(src), "--field", "body", "--out", str(out), "--quiet", "--workers=1"]
    assert PREPARE.main([*args, "--validation-percent=0"]) == 0
    assert [d.decode() for d in decoded_documents(out)] == texts()
    assert read_manifest(out).splits["validation"].num_documents == 0


def test_a_folder_of_files_in_parallel_equals_serial(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "UNIT_BYTES", 2000)  # many units for a small corpus
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for i, t in enumerate(texts(60)):
        (src / ("sub" if i % 3 else ".") / f"f{i:03d}.txt").write_text(t)
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    base = ["--input", str(src), "--glob", "**/*.txt", "--quiet", "--shard-tokens=3000"]
    assert PREPARE.main([*base, "--out", str(serial), "--workers=1"]) == 0
    assert PREPARE.main([*base, "--out", str(parallel), "--workers=2"]) == 0
    m = read_manifest(serial)
    assert len(m.splits["train"].shards) > 1
    assert (
        json.loads((serial / "manifest.json").read_text())["splits"]
        == json.loads((parallel / "manifest.json").read_text())["splits"]
    )
    for shard in m.splits["train"].shards:
        assert (serial / shard.file).read_bytes() == (parallel / shard.file).read_bytes()
    assert m.splits["train"].num_documents + m.splits["validation"].num_documents == 60


def test_an_interrupted_run_resumes_and_makes_the_same_dataset(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prep, "UNIT_BYTES", 3000)
    src = write_jsonl(tmp_path / "c.jsonl", texts(300))
    args = ["--input", str(src), "--quiet", "--workers=1"]
    assert PREPARE.main([*args, "--out", str(tmp_path / "clean")]) == 0

    real, calls = prep.tokenize_unit, []

    def dies_after_three(job):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the run is killed while unit 4 is tokenized
        calls.append(job)
        return real(job)

    monkeypatch.setattr(prep, "tokenize_unit", dies_after_three)
    assert PREPARE.main([*args, "--out", str(tmp_path / "out")]) == 130  # no traceback
    assert "run the same command again to resume" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and (tmp_path / "out.tmp").is_dir()
    monkeypatch.setattr(prep, "tokenize_unit", real)
    capsys.readouterr()
    assert PREPARE.main([*args, "--out", str(tmp_path / "out")]) == 0
    assert "resumed: 3 units were already tokenized" in capsys.readouterr().out
    assert not (tmp_path / "out.tmp").exists()
    for name in ("manifest.json", "train_00000.bin", "validation_00000.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes()


def test_the_same_recipe_is_a_no_op_and_another_is_refused(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", texts(20))
    out = tmp_path / "out"
    args = ["--input", str(src), "--out", str(out), "--quiet", "--workers=1"]
    assert PREPARE.main(args) == 0
    before = (out / "manifest.json").read_text()
    assert PREPARE.main(args) == 0
    assert "already holds this dataset" in capsys.readouterr().out
    write_jsonl(src, texts(21))  # the input changed
    assert PREPARE.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: --out {out}: holds a different dataset (another input, tokenizer or setting); choose another --out or delete it"
    ]
    assert (out / "manifest.json").read_text() == before


# (case, file content, text in the one error line)
BAD_INPUT = [
    ("not JSON", b'{"text": "ok"}\nnot json\n', "c.jsonl:2: not a JSON line"),
    ("missing field", b'{"text": "ok"}\n{"body": "x"}\n', "c.jsonl:2: no string field 'text'"),
    ("field not a string", b'{"text": 3}\n', "c.jsonl:1: no string field 'text'"),
    ("not UTF-8", b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n', "c.jsonl:3: not UTF-8"),
]  # fmt: skip


@pytest.mark.parametrize("content,text", [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_jsonl_is_one_line_exit_2_and_nothing_on_disk(tmp_path, capsys, content, text):
    (tmp_path / "c.jsonl").write_bytes(content)
    out = tmp_path / "out"
    assert PREPARE.main(["--input", str(tmp_path / "c.jsonl"), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


def test_errors_replace_decodes_bad_bytes_as_the_replacement_character(tmp_path):
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "c.jsonl"), "--out", str(out), "--quiet"]
    assert PREPARE.main([*args, "--errors=replace", "--validation-percent=0"]) == 0
    assert decoded_documents(out) == ["caf\ufffd".encode()]


def test_binary_files_are_skipped_and_counted(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    (src / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (src / "c.txt").write_text("world")
    out = tmp_path / "out"
    args = ["--input", str(src), "--out", str(out), "--quiet", "--validation-percent=0"]
    assert PREPARE.main(args) == 0
    assert sorted(decoded_documents(out)) == [b"hello", b"world"]
    assert "skipped 1 binary files" in capsys.readouterr().out


def write_files(folder, files):
    """``{name: bytes}`` as files in ``folder``; the folder."""
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"

# (case, the input under tmp_path, extra arguments, the one error line after "error: --input <input>: ")
NO_TEXT = [
    ("only binary files", lambda d: write_files(d / "src", {"a.png": PNG, "b.bin": b"x\0y"}), [], "holds no text to tokenize (2 binary files skipped); point --input at text files, or choose them with --glob"),
    ("only empty files", lambda d: write_files(d / "src", {"a.txt": b"", "b.txt": b""}), [], "holds no text to tokenize (2 empty documents); point --input at text files, or choose them with --glob"),
    ("binary and empty files", lambda d: write_files(d / "src", {"a.png": PNG, "b.txt": b""}), [], "holds no text to tokenize (1 binary file skipped, 1 empty document); point --input at text files, or choose them with --glob"),
    ("only blank JSONL lines", lambda d: write_files(d, {"c.jsonl": b"\n  \n\n"}) / "c.jsonl", [], "holds no text to tokenize (every line is blank); point --input at JSONL lines whose --field 'text' holds text"),
    ("JSONL of empty texts", lambda d: write_jsonl(d / "c.jsonl", ["", ""], field="body"), ["--field=body"], "holds no text to tokenize (2 empty documents); point --input at JSONL lines whose --field 'body' holds text"),
]  # fmt: skip


@pytest.mark.parametrize("make,extra,text", [c[1:] for c in NO_TEXT], ids=[c[0] for c in NO_TEXT])
@pytest.mark.parametrize("workers", [1, 2])
def test_input_without_text_is_one_line_exit_2_and_writes_nothing(
    tmp_path, capsys, make, extra, text, workers
):
    src = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    out = tmp_path / "out"
    args = ["--input", str(src), "--out", str(out), "--quiet", f"--workers={workers}", *extra]
    assert PREPARE.main(args) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --input {src}: {text}"]
    assert sorted(tmp_path.rglob("*")) == before  # no out, no out.tmp


def test_an_empty_validation_split_warns(tmp_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", texts(3))
    args = ["--input", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o"), "--quiet"]
    assert PREPARE.main([*args, "--validation-percent=0"]) == 0
    assert "warning: the validation split is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option,text",
    [
        ("--validation-percent=-1", "--validation-percent: must be in [0, 100], got -1.0"),
        ("--validation-percent=nan", "--validation-percent: must be in [0, 100], got nan"),
        ("--shard-tokens=0", "--shard-tokens: must be > 0, got 0"),
        ("--workers=0", "--workers: must be >= 1, got 0"),
    ],
)
def test_out_of_range_options_are_one_line(tmp_path, capsys, option, text):
    write_jsonl(tmp_path / "c.jsonl", texts(3))
    out = tmp_path / "o"
    assert PREPARE.main(["--input", str(tmp_path / "c.jsonl"), "--out", str(out), option]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {text}"]
    assert not out.exists()


def test_a_failed_write_is_one_line_and_leaves_no_temporary_folder(tmp_path, capsys, monkeypatch):
    write_jsonl(tmp_path / "c.jsonl", texts(30))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prep, "publish", disk_full)
    out = tmp_path / "out"
    assert PREPARE.main(["--input", str(tmp_path / "c.jsonl"), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


def test_out_inside_a_dataset_or_a_run_is_refused_and_nothing_written(tmp_path, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "hello world"}\n' * 40)
    out = tmp_path / "ds"
    args = ["--input", str(src), "--quiet", "--workers=1"]
    assert PREPARE.main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in out.rglob("*"))
    assert PREPARE.main([*args, "--out", str(out / "sub")]) == 2
    assert f"--out {out / 'sub'}: lies inside the dataset {out}" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == before
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("")
    assert PREPARE.main([*args, "--out", str(run / "data")]) == 2
    assert "lies in the run or checkpoint directory" in capsys.readouterr().err
    assert not (run / "data").exists() and not (run / "data.tmp").exists()


def test_a_fifo_as_input_is_named_as_such(tmp_path, capsys):
    fifo = tmp_path / "x.parquet"
    os.mkfifo(fifo)
    assert PREPARE.main(["--input", str(fifo), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        "is not a regular file or a folder (a pipe or a device)" in err and "Traceback" not in err
    )


def test_missing_input_is_refused(tmp_path, capsys):
    assert PREPARE.main(["--input", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


@pytest.fixture
def hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(texts(), trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_frames_documents_with_its_own_tokens(tmp_path, hf_tokenizer):
    from forge.data.tokenizer import tokenizer_from_manifest

    src = write_jsonl(tmp_path / "c.jsonl", texts(40))
    out = tmp_path / "out"
    args = ["--input", str(src), "--tokenizer", str(hf_tokenizer), "--out", str(out), "--quiet"]
    assert PREPARE.main([*args, "--validation-percent=0"]) == 0
    m = read_manifest(out)
    assert m.tokenizer["type"] == "hf" and m.tokenizer["bos_token"] == "<s>"
    tok = tokenizer_from_manifest(m.tokenizer)
    assert m.vocab_size == tok.vocab_size <= 300
    tokens = np.concatenate(open_split(out, m, "train", verify=True)).tolist()
    assert tokens.count(tok.bos_id) == tokens.count(tok.eos_id) == 40
    first = tokens[1 : tokens.index(tok.eos_id)]
    assert tok.decode(first).strip() == texts()[0].strip()  # ByteLevel adds a leading space


def test_hf_tokenizer_without_a_known_boundary_token_is_refused(tmp_path, hf_tokenizer, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", texts(5))
    args = ["--input", str(src), "--tokenizer", str(hf_tokenizer), "--out", str(tmp_path / "o")]
    assert PREPARE.main([*args, "--bos-token", "<bos>"]) == 2
    assert "--bos-token '<bos>': not in the vocabulary" in capsys.readouterr().err


def test_ctrl_c_to_the_process_group_with_workers_is_one_line_and_exit_130(tmp_path):
    """As a terminal's Ctrl-C: SIGINT to the script and its tokenizer workers at once. The
    workers leave it to the main process (no traceback of theirs), which keeps the finished
    units for the same command to resume."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "ds"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--out", str(out), "--workers", "2"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    seen = ""
    while "[prepare]" not in seen:  # a unit is done: the workers are at work
        chunk = os.read(proc.stderr.fileno(), 4096).decode()
        assert chunk, seen
        seen += chunk
    os.killpg(proc.pid, signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, seen + rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    assert [line for line in rest.splitlines() if "interrupted" in line] == [
        f"interrupted: the finished units are kept in {out}.tmp; run the same command again to resume"
    ]
