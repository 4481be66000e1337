"""Tokenizer, shard format, windows, sampler and the stateful loader."""

from __future__ import annotations

import json

import numpy as np
import pytest

from forge.data.corpus import Document, split_of
from forge.data.dataset import TokenWindows
from forge.data.sampler import epoch_permutation, sample_at
from forge.data.shards import DataError, open_split, read_manifest
from forge.data.tokenizer import ByteTokenizer
from tests.conftest import make_dataset


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'ünïcode ✓'\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert max(ids[1:-1]) < 256
    assert tok.decode(ids) == text


def test_split_is_a_stable_function_of_the_name():
    names = [f"pkg/mod{i}.py" for i in range(2000)]
    first = [split_of(n, 5.0) for n in names]
    assert first == [split_of(n, 5.0) for n in names]
    share = first.count("validation") / len(first)
    assert 0.03 < share < 0.07


@pytest.fixture
def dataset(tmp_path):
    docs = [Document(f"d{i}", bytes(range(65, 65 + 20)) * (i + 1)) for i in range(10)]
    return make_dataset(tmp_path / "ds", {"train": docs, "validation": docs[:2]})


def test_manifest_records_counts_dtype_and_checksums(dataset):
    m = read_manifest(dataset)
    assert m.dtype == "uint16" and m.vocab_size == 259
    assert m.splits["train"].num_documents == 10
    assert m.splits["train"].num_tokens == sum(20 * (i + 1) + 2 for i in range(10))
    assert all(len(s.sha256) == 64 for s in m.splits["train"].shards)
    arrays = open_split(dataset, m, "train", verify=True)
    assert arrays[0][0] == 256 and arrays[0][21] == 257  # BOS ... EOS framing


def test_no_temporary_folder_is_left_behind(dataset):
    assert not dataset.with_name(dataset.name + ".tmp").exists()


def test_missing_manifest_names_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"prepare_data\.py --out"):
        read_manifest(tmp_path / "nowhere")


def test_malformed_manifest(dataset):
    (dataset / "manifest.json").write_text(json.dumps({"dtype": "uint16"}))
    with pytest.raises(DataError, match="malformed manifest"):
        read_manifest(dataset)


# (case, the manifest's format_version, text the one error line holds)
FORMAT_VERSIONS = [
    ("a newer forge's", 99, "format_version 99 is a newer forge's (this forge reads format_version 1); upgrade forge"),
    ("zero", 0, "format_version 0 is not one forge writes (this forge reads format_version 1)"),
    ("a string", "1", "format_version '1' is not one forge writes"),
    ("a float", 1.0, "format_version 1.0 is not one forge writes"),
    ("a boolean", True, "format_version True is not one forge writes"),
    ("null", None, "format_version None is not one forge writes"),
]  # fmt: skip


@pytest.mark.parametrize(
    "version,text", [v[1:] for v in FORMAT_VERSIONS], ids=[v[0] for v in FORMAT_VERSIONS]
)
def test_a_format_version_this_forge_does_not_read_is_refused(dataset, version, text):
    raw = json.loads((dataset / "manifest.json").read_text())
    (dataset / "manifest.json").write_text(json.dumps({**raw, "format_version": version}))
    with pytest.raises(DataError) as caught:
        read_manifest(dataset)
    [line] = caught.value.lines
    assert line.startswith(f"{dataset / 'manifest.json'}: {text}"), line


def test_a_manifest_without_a_format_version_is_malformed(dataset):
    raw = json.loads((dataset / "manifest.json").read_text())
    del raw["format_version"]
    (dataset / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"malformed manifest \(KeyError\('format_version'\)\)"):
        read_manifest(dataset)


def test_checksum_mismatch(dataset):
    m = read_manifest(dataset)
    shard = dataset / m.splits["train"].shards[0].file
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum mismatch"):
        open_split(dataset, m, "train", verify=True)
    open_split(dataset, m, "train", verify=False)  # the switch skips it


def test_truncated_shard(dataset):
    m = read_manifest(dataset)
    shard = dataset / m.splits["train"].shards[0].file
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(DataError, match="manifest says"):
        open_split(dataset, m, "train", verify=False)


def test_missing_split(dataset):
    with pytest.raises(DataError, match="no split 'test'"):
        open_split(dataset, read_manifest(dataset), "test", verify=False)


def test_windows_overlap_by_one_token_and_stay_inside_shards():
    shards = [np.arange(10), np.arange(100, 108)]
    w = TokenWindows(shards, seq_len=3)
    assert len(w) == 3 + 2
    assert w[0].tolist() == [0, 1, 2, 3]
    assert w[2].tolist() == [6, 7, 8, 9]
    assert w[3].tolist() == [100, 101, 102, 103]
    with pytest.raises(IndexError):
        w[5]


def test_permutation_is_a_pure_function_of_seed_and_epoch():
    a = epoch_permutation(1, 0, 50)
    assert np.array_equal(a, epoch_permutation(1, 0, 50))
    assert sorted(a.tolist()) == list(range(50))
    assert not np.array_equal(a, epoch_permutation(1, 1, 50))
    assert not np.array_equal(a, epoch_permutation(2, 0, 50))
    assert sample_at(1, 0, 7, 50) == int(a[7])
