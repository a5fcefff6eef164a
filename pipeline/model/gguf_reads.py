"""One parse of a GGUF file per load: transformers reads its metadata several times and rebuilds a name map per
module.

Loading a GGUF model and its tokenizer through transformers (5.23) parses the file's metadata four times (the
config, the weights, the tokenizer's config, the tokenizer), each a GGUFReader walking every vocabulary entry and
merge through numpy one element at a time, and builds gguf's tensor name map once per module of the model (397 for
SmolLM2). SmolLM2's download spent 22 s there, 3 of it dequantizing. Within `shared_gguf_reads()` one reader per
file serves every parse, a metadata-only parse is done once and handed out as a copy, and the name map is built
once per (architecture, layer count): the same model and tokenizer, bit for bit (tests/model/test_gguf_reads.py).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os


@contextlib.contextmanager
def shared_gguf_reads():
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    reader_class, load, name_map = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map
    readers: dict = {}
    parsed: dict = {}

    def shared_reader(path, *args, **kwargs):
        if args or kwargs:  # another mode than read-only: not shared
            return reader_class(path, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = reader_class(path)
        return readers[key]

    def load_once(path, return_tensors=False, model_to_load=None, torch_dtype=None):
        if return_tensors or model_to_load is not None:
            return load(path, return_tensors=return_tensors, model_to_load=model_to_load, torch_dtype=torch_dtype)
        key = (os.path.realpath(path), torch_dtype)
        if key not in parsed:
            parsed[key] = load(path, return_tensors=False, torch_dtype=torch_dtype)
        return copy.deepcopy(parsed[key])  # callers edit what they get

    gguf.GGUFReader = shared_reader
    hf_gguf.load_gguf_checkpoint = load_once
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map = reader_class, load, name_map
