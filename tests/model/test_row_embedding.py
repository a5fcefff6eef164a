"""Eager torchao embeddings that dequantize only the gathered rows give torchao's own values
(pipeline/model/layers/row_embedding.py), in every scheme and group an embedding takes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.model.quant.apply import torchao_config
from pipeline.model.layers.row_embedding import rows_only


@pytest.mark.parametrize("scheme,group", [("8w", 32), ("8w", 0), ("4w", 32), ("4w", 64)])
def test_rows_only_equals_the_whole_table(scheme, group):
    from torchao.quantization import quantize_
    torch.manual_seed(0)
    emb = nn.Embedding(300, 128)
    quantize_(emb, torchao_config(scheme, group), filter_fn=lambda m, _: isinstance(m, nn.Embedding))
    ids = torch.tensor([[0, 5, 299, 5], [17, 3, 3, 250]])
    with torch.no_grad():
        whole = emb(ids)
        with rows_only():
            rows = emb(ids)
        after = emb(ids)  # the table is restored on exit
    assert rows.shape == whole.shape == (2, 4, 128)
    assert torch.equal(rows, whole) and torch.equal(after, whole)
