"""Packed documents: ids, positions, masked labels and the block-diagonal causal mask."""

from __future__ import annotations

import pytest
import torch

from forge.config import ModelConfig
from forge.data.packing import IGNORE_INDEX, pack
from forge.model.transformer import Transformer, document_attention_mask

B, E = 256, 257  # BOS, EOS of the byte tokenizer
X = IGNORE_INDEX

# window (T + 1 tokens) -> expected inputs' document ids, positions, labels
CASES = {
    "one whole document": (
        [B, 1, 2, E, 9],
        [1, 1, 1, 1], [0, 1, 2, 3], [1, 2, E, 9],
    ),
    "two documents": (
        [B, 1, E, B, 2, E],
        [1, 1, 1, 2, 2], [0, 1, 2, 0, 1], [1, E, X, 2, E],
    ),
    "starts inside a document": (
        [5, 6, E, B, 7, 8],
        [0, 0, 0, 1, 1], [0, 1, 2, 0, 1], [6, E, X, 7, 8],
    ),
    "one-token documents back to back": (
        [B, B, B, 4],
        [1, 2, 3], [0, 0, 0], [X, X, 4],
    ),
    "boundary is the last label": (
        [B, 3, E, B],
        [1, 1, 1], [0, 1, 2], [3, E, X],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_pack_table(case):
    window, ids, positions, labels = CASES[case]
    p = pack(torch.tensor([window]), bos_id=B)
    assert p.inputs.tolist() == [window[:-1]]
    assert p.document_ids.tolist() == [ids]
    assert p.positions.tolist() == [positions]
    assert p.labels.tolist() == [labels]


def test_mask_is_causal_and_block_diagonal():
    mask = document_attention_mask(torch.tensor([[1, 1, 2, 2, 2]]))
    assert mask.shape == (1, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


def test_a_packed_row_computes_each_document_as_if_alone():
    """Logits of two packed documents equal each document's logits run on its own."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32))
    model.eval()
    doc_a, doc_b = [B, 5, 6, 7, E], [B, 8, 9, 10, 11, 12, E]
    p = pack(torch.tensor([doc_a + doc_b + [B]]), bos_id=B)
    packed = model(p.inputs, positions=p.positions, document_ids=p.document_ids)
    alone_a = model(torch.tensor([doc_a]))
    alone_b = model(torch.tensor([doc_b]))
    torch.testing.assert_close(packed[:, : len(doc_a)], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, len(doc_a) :], alone_b, rtol=1e-5, atol=1e-5)
    unpacked = model(p.inputs)  # without the mask, document b sees document a
    assert not torch.allclose(unpacked[:, len(doc_a) :], alone_b, atol=1e-3)
