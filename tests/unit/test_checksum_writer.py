"""Shards checksummed while DCP writes them equal a read-back of the files, however the
writes fall against the pieces' boundaries."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from forge.checkpoint.checksum_writer import ChecksummingWriter, HashingFileSystem, hashing_pool
from forge.checkpoint.integrity import checksums_of

SMALL_PIECE = 8192  # a multiple of the page size, as a memory map's offset must be


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr("forge.checkpoint.checksum_writer.PIECE", SMALL_PIECE)
    monkeypatch.setattr("forge.checkpoint.integrity.PIECE", SMALL_PIECE)
    pool = hashing_pool()
    yield pool
    pool.shutdown()


# (case, the sizes of the successive writes)
WRITES = [
    ("an empty file", []),
    ("one byte", [1]),
    ("exactly one piece", [SMALL_PIECE]),
    ("one piece and a byte", [SMALL_PIECE, 1]),
    ("small writes across boundaries", [1000] * 30),
    ("one write over three and a half pieces", [int(3.5 * SMALL_PIECE)]),
    ("a write ending a byte short of a boundary, then one across it", [SMALL_PIECE - 1, 2, 5]),
]


@pytest.mark.parametrize("sizes", [w[1] for w in WRITES], ids=[w[0] for w in WRITES])
def test_a_shard_checksummed_while_written_equals_its_read_back(tmp_path, small_pieces, sizes):
    fs = HashingFileSystem(small_pieces)
    payload = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8).numpy().tobytes()
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        offset = 0
        for size in sizes:
            stream.write(payload[offset : offset + size])
            offset += size
    assert (
        fs.hashers["__0_0.distcp"].result()
        == checksums_of(tmp_path, ["__0_0.distcp"])["__0_0.distcp"]
    )


def test_a_dcp_save_through_the_writer_records_every_shard_as_read_back(tmp_path, small_pieces):
    state = {"w": torch.randn(64, 97), "b": torch.randn(1000), "step": torch.tensor(3)}
    writer = ChecksummingWriter(tmp_path, small_pieces)
    dcp_save(state, checkpoint_id=str(tmp_path), storage_writer=writer)
    sums = writer.checksums()
    shards = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert sorted(sums) == shards and ".metadata" not in sums  # small files: read back later
    assert sums == checksums_of(tmp_path, shards)
    assert len(sums[shards[0]][1]) > 1  # the shard spans several pieces
