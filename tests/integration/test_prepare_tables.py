"""scripts/prepare_data.py on Parquet, Arrow IPC and Hugging Face datasets: the same tokens as
the same texts in JSONL, 1 worker = 2 workers, resume, recipes, and bad input as one line.
Offline: every dataset is written here, and the Hub is never tried."""

from __future__ import annotations

import json
import os
import sys

import pytest

import forge.data.prepare as prep
from forge.data.recipe import InputFormat, Recipe
from forge.data.shards import read_manifest
from forge.data.tables import piece_ranges, unit_target
from tests.integration.test_prepare import PREPARE, decoded_documents, texts, write_jsonl

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports datasets or huggingface_hub
os.environ["HF_DATASETS_OFFLINE"] = "1"

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    """No network and no writes to the user's cache, here and in spawned workers."""
    cache = tmp_path_factory.getbasetemp() / "hf_cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


def table(n=300, nulls=()):
    """Rows ``id``, ``text`` (``texts(n)``, with None at the rows in ``nulls``)."""
    column = [None if i in nulls else t for i, t in enumerate(texts(n))]
    return pa.table({"id": list(range(n)), "text": pa.array(column, pa.string())})


def write_ipc(path, t, stream, rows=40):
    """``t`` as an Arrow IPC file (stream or file format) of ``rows``-row record batches."""
    with pa.OSFile(str(path), "wb") as f:
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        with new(f, t.schema) as writer:
            for batch in t.to_batches(max_chunksize=rows):
                writer.write_batch(batch)
    return path


# --- inputs: each writes ``table()`` under the folder and returns the arguments naming it


def parquet_file(d):
    pq.write_table(table(), d / "c.parquet", row_group_size=40)  # 8 row groups
    return ["--input", str(d / "c.parquet")]


def parquet_folder(d):
    (d / "pq" / "sub").mkdir(parents=True)
    t = table()
    pq.write_table(t.slice(0, 100), d / "pq" / "a.parquet", row_group_size=30)
    pq.write_table(t.slice(100, 150), d / "pq" / "b.parquet", row_group_size=30)
    pq.write_table(t.slice(250), d / "pq" / "sub" / "c.parquet")
    (d / "pq" / "_SUCCESS").write_text("")  # what Spark leaves: not matched by the glob
    return ["--input", str(d / "pq"), "--format", "parquet"]


def arrow_file(d):
    return ["--input", str(write_ipc(d / "c.arrow", table(), stream=False))]


def arrow_stream(d):
    return ["--input", str(write_ipc(d / "c.arrow", table(), stream=True))]


def saved_dataset(d):
    datasets.Dataset.from_dict(table().to_pydict()).save_to_disk(str(d / "saved"), num_shards=3)
    return ["--hf-dataset", str(d / "saved")]


def saved_dataset_dict(d):
    full = datasets.Dataset.from_dict(table().to_pydict())
    splits = datasets.DatasetDict({"test": full.select(range(5)), "train": full})
    splits.save_to_disk(str(d / "saved"), num_shards={"test": 1, "train": 2})
    return ["--hf-dataset", str(d / "saved"), "--hf-split", "train"]


def streamed_folder(d):
    """A local folder of data files, as on the Hub: streamed through ``load_dataset``."""
    (d / "ds" / "data").mkdir(parents=True)
    t = table()
    pq.write_table(t.slice(0, 120), d / "ds" / "data" / "train-00000-of-00002.parquet")
    pq.write_table(t.slice(120), d / "ds" / "data" / "train-00001-of-00002.parquet")
    pq.write_table(t.slice(0, 5), d / "ds" / "data" / "test-00000-of-00001.parquet")
    return ["--hf-dataset", str(d / "ds")]


INPUTS = [parquet_file, parquet_folder, arrow_file, arrow_stream, saved_dataset,
          saved_dataset_dict, streamed_folder]  # fmt: skip


def prepared(folder):
    """What a dataset folder holds: its splits' counts and every shard's bytes."""
    m = read_manifest(folder)
    shards = {
        s.file: (folder / s.file).read_bytes() for info in m.splits.values() for s in info.shards
    }
    counts = {k: (v.num_documents, v.num_tokens) for k, v in m.splits.items()}
    return counts, shards


@pytest.fixture
def as_jsonl(tmp_path):
    """The dataset of ``texts(300)`` prepared from JSONL, all in train."""
    out = tmp_path / "jsonl"
    src = write_jsonl(tmp_path / "c.jsonl", texts(300))
    args = ["--input", str(src), "--out", str(out), "--quiet", "--validation-percent=0"]
    assert PREPARE.main(args) == 0
    return prepared(out)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("make", INPUTS, ids=[f.__name__ for f in INPUTS])
def test_a_table_makes_the_same_shards_as_its_texts_in_jsonl(
    tmp_path, monkeypatch, as_jsonl, make, workers
):
    monkeypatch.setattr(prep, "UNIT_BYTES", 3000)  # several units, also from small tables
    out = tmp_path / "out"
    args = [*make(tmp_path), "--out", str(out), "--quiet", f"--workers={workers}"]
    assert PREPARE.main([*args, "--validation-percent=0"]) == 0
    assert prepared(out) == as_jsonl  # byte-identical shards, same counts


@pytest.mark.parametrize("make", [parquet_file, arrow_stream, streamed_folder],
                         ids=["parquet", "arrow stream", "streamed dataset"])  # fmt: skip
def test_held_out_rows_are_split_off_and_none_is_lost(tmp_path, make):
    out = tmp_path / "out"
    assert (
        PREPARE.main([*make(tmp_path), "--out", str(out), "--quiet", "--validation-percent=30"])
        == 0
    )
    train, validation = decoded_documents(out), decoded_documents(out, "validation")
    assert len(validation) > 0 and len(train) > len(validation)
    assert sorted(train + validation) == sorted(t.encode() for t in texts(300))


@pytest.mark.parametrize("make,kill_after", [(parquet_file, 3), (arrow_file, 3), (streamed_folder, 1)],
                         ids=["parquet", "arrow", "streamed dataset"])  # fmt: skip
def test_an_interrupted_run_resumes_and_makes_the_same_dataset(
    tmp_path, monkeypatch, capsys, make, kill_after
):
    monkeypatch.setattr(prep, "UNIT_BYTES", 3000)
    args = [*make(tmp_path), "--quiet", "--workers=1"]
    assert PREPARE.main([*args, "--out", str(tmp_path / "clean")]) == 0
    real, calls = prep.tokenize_unit, []

    def dies(job):
        if len(calls) == kill_after:
            raise KeyboardInterrupt  # killed while the next unit is tokenized
        calls.append(job)
        return real(job)

    monkeypatch.setattr(prep, "tokenize_unit", dies)
    assert PREPARE.main([*args, "--out", str(tmp_path / "out")]) == 130
    assert (tmp_path / "out.tmp").is_dir() and not (tmp_path / "out").exists()
    monkeypatch.setattr(prep, "tokenize_unit", real)
    capsys.readouterr()
    assert PREPARE.main([*args, "--out", str(tmp_path / "out")]) == 0
    assert f"resumed: {kill_after} units were already tokenized" in capsys.readouterr().out
    assert prepared(tmp_path / "out") == prepared(tmp_path / "clean")
    assert (tmp_path / "out" / "manifest.json").read_bytes() == (
        tmp_path / "clean" / "manifest.json"
    ).read_bytes()


def test_the_recipe_names_format_field_and_inputs_and_another_is_refused(tmp_path, capsys):
    args = [*parquet_folder(tmp_path), "--out", str(tmp_path / "out"), "--quiet"]
    assert PREPARE.main(args) == 0
    recipe = json.loads((tmp_path / "out" / "manifest.json").read_text())["recipe"]
    assert recipe["input_format"] == "parquet" and recipe["field"] == "text"
    sizes = {p.relative_to(tmp_path / "pq").as_posix(): p.stat().st_size
             for p in (tmp_path / "pq").rglob("*.parquet")}  # fmt: skip
    assert dict(map(tuple, recipe["inputs"])) == sizes
    assert "hf_split" not in recipe  # only for --hf-dataset
    assert PREPARE.main(args) == 0
    assert "already holds this dataset" in capsys.readouterr().out
    pq.write_table(table(5), tmp_path / "pq" / "a.parquet")  # an input changed
    assert PREPARE.main(args) == 2
    assert "holds a different dataset" in capsys.readouterr().err


def test_a_streamed_dataset_recipe_records_config_and_split(tmp_path):
    out = tmp_path / "out"
    assert (
        PREPARE.main(
            [
                *streamed_folder(tmp_path),
                "--hf-split",
                "test",
                "--out",
                str(out),
                "--quiet",
                "--validation-percent=0",
            ]
        )
        == 0
    )
    recipe = json.loads((out / "manifest.json").read_text())["recipe"]
    assert recipe["input_format"] == "hf" and recipe["hf_split"] == "test"
    assert recipe["root"] == str((tmp_path / "ds").resolve()) and len(recipe["inputs"]) == 3
    assert decoded_documents(out) == [t.encode() for t in texts(5)]


def test_null_texts_are_skipped_and_counted(tmp_path, capsys):
    pq.write_table(table(20, nulls={3, 7}), tmp_path / "c.parquet")
    out = tmp_path / "out"
    assert (
        PREPARE.main(
            [
                "--input",
                str(tmp_path / "c.parquet"),
                "--out",
                str(out),
                "--quiet",
                "--validation-percent=0",
            ]
        )
        == 0
    )
    assert "skipped 2 null texts (rows whose 'text' is null)" in capsys.readouterr().out
    assert decoded_documents(out) == [
        t.encode() for i, t in enumerate(texts(20)) if i not in (3, 7)
    ]


# --- bad input: each setup writes it under the folder (given pytest's monkeypatch too) and
# returns the arguments; the one error line must contain the text


def cut_parquet(d, mp):
    pq.write_table(table(), d / "c.parquet", row_group_size=40)
    data = (d / "c.parquet").read_bytes()
    (d / "c.parquet").write_bytes(data[: len(data) // 2])
    return ["--input", str(d / "c.parquet")]


def damaged_parquet_pages(d, mp):
    """The footer intact, the first page headers zeroed: found only when a unit is read."""
    pq.write_table(table(), d / "c.parquet", row_group_size=40)
    data = bytearray((d / "c.parquet").read_bytes())
    data[4:400] = bytes(396)
    (d / "c.parquet").write_bytes(bytes(data))
    return ["--input", str(d / "c.parquet"), "--workers=2"]


def parquet_of(t, *extra):
    def setup(d, mp):
        pq.write_table(t, d / "c.parquet")
        return ["--input", str(d / "c.parquet"), *extra]

    return setup


def cut_arrow(stream):
    def setup(d, mp):
        data = write_ipc(d / "c.arrow", table(), stream=stream).read_bytes()
        (d / "c.arrow").write_bytes(data[: len(data) // 2 + 7])
        return ["--input", str(d / "c.arrow")]

    return setup


def jsonl_as_arrow(d, mp):
    return ["--input", str(write_jsonl(d / "c.jsonl", texts(3))), "--format", "arrow"]


def empty_folder(*extra):
    def setup(d, mp):
        (d / "empty").mkdir()
        return [*extra, str(d / "empty")]

    return setup


def with_dataset(make, *extra):
    return lambda d, mp: [*make(d), *extra]


def not_on_the_hub(d, mp):
    def load_dataset(*args, **kwargs):
        raise datasets.exceptions.DatasetNotFoundError(
            "Dataset 'someone/nothing' doesn't exist on the Hub or cannot be accessed."
        )

    mp.setattr(datasets, "load_dataset", load_dataset)
    return ["--hf-dataset", "someone/nothing"]


def without(module, *args):
    def setup(d, mp):
        mp.setitem(sys.modules, module, None)  # ``import module`` now raises ImportError
        return [arg.format(d=d) for arg in args]

    return setup


def without_pyarrow(d, mp):
    pq.write_table(table(), d / "c.parquet")
    return without("pyarrow", "--input", "{d}/c.parquet")(d, mp)


INTS = pa.table({"id": [1, 2], "body": ["a", "b"]})
NUMBERS = pa.table({"text": [1, 2]})
NULLS = pa.table({"text": pa.array([None, None], pa.string())})
EXTRA = "needs the 'data' extra: pip install -e '.[data]'"

BAD = [
    ("truncated Parquet", cut_parquet, "c.parquet: not a Parquet file, or a damaged one (ArrowInvalid: Parquet magic bytes not found in footer"),
    ("damaged Parquet pages", damaged_parquet_pages, "c.parquet: row groups 0-7: cannot be read, damaged or truncated"),
    ("missing column", parquet_of(INTS), "c.parquet: no column 'text' (columns: id, body); choose the text column with --field"),
    ("column not strings", parquet_of(NUMBERS), "c.parquet: column 'text' holds int64, not strings; choose the text column with --field"),
    ("every text null", parquet_of(NULLS), "holds no text to tokenize (2 null texts skipped); choose a column that holds text with --field (now 'text')"),
    ("no rows", parquet_of(NULLS.slice(0, 0)), "holds no text to tokenize (no rows)"),
    ("truncated Arrow stream", cut_arrow(stream=True), "c.arrow: cannot be read, damaged or truncated (OSError: Expected to be able to read"),
    ("truncated Arrow file", cut_arrow(stream=False), "c.arrow: not an Arrow IPC file, or a damaged one (read as the file format"),
    ("not Arrow", jsonl_as_arrow, "c.jsonl: not an Arrow IPC file, or a damaged one (read as the stream format"),
    ("empty folder, parquet", empty_folder("--format=parquet", "--input"), "empty: no file matches --glob '**/*.parquet'"),
    ("empty folder, dataset", empty_folder("--hf-dataset"), "empty: cannot be loaded (EmptyDatasetError"),
    ("unknown dataset, offline", lambda d, mp: ["--hf-dataset", "someone/nothing"], "--hf-dataset someone/nothing: not a local folder, and the Hugging Face Hub cannot be reached"),
    ("unknown dataset on the Hub", not_on_the_hub, "--hf-dataset someone/nothing: no such dataset, locally or on the Hub"),
    ("unknown split", with_dataset(streamed_folder, "--hf-split", "validation"), "--hf-split validation: not a split of"),
    ("unknown config", with_dataset(streamed_folder, "--hf-config", "tiny"), "--hf-config tiny: not a configuration of"),
    ("dataset without the column", with_dataset(streamed_folder, "--field", "body"), "no column 'body' (columns: id, text)"),
    ("unknown split of a saved DatasetDict", with_dataset(saved_dataset_dict, "--hf-split", "dev"), "--hf-split dev: not a split of"),
    ("config of a saved dataset", with_dataset(saved_dataset, "--hf-config", "x"), "--hf-config x:"),
    ("pyarrow missing", without_pyarrow, f"--input {{d}}/c.parquet: reading Parquet and Arrow {EXTRA}"),
    ("datasets missing", without("datasets", "--hf-dataset", "{d}/ds"), f"--hf-dataset {{d}}/ds: reading Hugging Face datasets {EXTRA}"),
    ("two inputs", with_dataset(streamed_folder, "--input", "c.jsonl"), "--input: not with --hf-dataset"),
    ("split without a dataset", lambda d, mp: ["--hf-split", "train"], "--hf-split: only with --hf-dataset"),
]  # fmt: skip


@pytest.mark.parametrize("setup,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_exit_2_and_nothing_on_disk(
    tmp_path, monkeypatch, capsys, setup, text
):
    args = setup(tmp_path, monkeypatch)
    before = sorted(tmp_path.rglob("*"))
    assert PREPARE.main([*args, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and text.format(d=tmp_path) in err[0], err
    assert err[0].startswith("error: ")
    assert sorted(tmp_path.rglob("*")) == before  # no out, no out.tmp


# (sizes of the pieces, target bytes per unit, the ranges)
PIECES = [
    ([], 10, []),
    ([5], 10, [(0, 1)]),
    ([5, 5, 5], 10, [(0, 2), (2, 3)]),
    ([10, 1, 9, 30], 10, [(0, 1), (1, 3), (3, 4)]),
    ([0, 0, 0], 10, [(0, 3)]),
]


@pytest.mark.parametrize("sizes,target,ranges", PIECES)
def test_pieces_are_cut_into_consecutive_ranges_of_the_target_size(sizes, target, ranges):
    assert list(piece_ranges(sizes, target)) == ranges


# (input sizes, UNIT_BYTES, bytes per unit)
TARGETS = [
    ([1 << 30], 4 << 20, 4 << 20),  # a large input: units of UNIT_BYTES
    ([8 << 20, 8 << 20], 4 << 20, 512 << 10),  # 16 MB: 32 units of 512 KB
    ([1000], 4 << 20, 256 << 10),  # tiny: never below a 16th of UNIT_BYTES
]


@pytest.mark.parametrize("sizes,unit_bytes,target", TARGETS)
def test_a_small_table_is_cut_into_smaller_units_whatever_the_workers(sizes, unit_bytes, target):
    inputs = tuple((f"f{i}.parquet", n) for i, n in enumerate(sizes))
    recipe = Recipe("/", inputs, InputFormat.PARQUET, "text", {}, 0.0, 1 << 24)
    assert unit_target(recipe, unit_bytes) == target
