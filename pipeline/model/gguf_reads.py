"""One quick parse of a GGUF file per load: transformers reads its metadata several times and rebuilds a name map
per module.

Loading a GGUF model and its tokenizer through transformers (5.23) parses the file's metadata several times (the
config, the weights, the tokenizer's config), each a GGUFReader walking every vocabulary entry and merge through
numpy, and builds gguf's tensor name map once per module of the model (397 for SmolLM2). SmolLM2's download spent
22 s there, 3 of it dequantizing. Within `shared_gguf_reads()` one reader per file serves every parse, and it reads
each element with one np.frombuffer where the stock reader slices and views the memmap several times (gemma-3-270m's
777k vocabulary strings: 13.5 -> 4.1 s); a metadata-only parse is done once, its config handed out as a copy; the
name map is built once per (architecture, layer count). The same model and tokenizer, bit for bit
(tests/model/test_gguf_reads.py).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os

import numpy as np


def quick_reader_class(reader_class):
    """GGUFReader with one np.frombuffer per element read: the same arrays (dtype, values, read-only views of the
    file), for a file in the machine's byte order; anything else reads as the stock reader does."""

    class QuickReader(reader_class):
        def _get(self, offset, dtype, count=1, override_order=None):
            if self.byte_order != "I" or override_order not in (None, "I"):
                return super()._get(offset, dtype, count, override_order)
            try:
                return np.frombuffer(self.data, dtype=dtype, count=int(count), offset=int(offset))
            except ValueError:  # past the end of a damaged file: the stock reader's (short) answer
                return super()._get(offset, dtype, count, override_order)

    return QuickReader


@contextlib.contextmanager
def shared_gguf_reads():
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    reader_class, load, name_map = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map
    quick = quick_reader_class(reader_class)
    readers: dict = {}
    parsed: dict = {}

    def shared_reader(path, *args, **kwargs):
        if args or kwargs:  # another mode than read-only: not shared
            return reader_class(path, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = quick(path)
        return readers[key]

    def load_once(path, return_tensors=False, model_to_load=None, torch_dtype=None):
        if return_tensors or model_to_load is not None:
            return load(path, return_tensors=return_tensors, model_to_load=model_to_load, torch_dtype=torch_dtype)
        key = (os.path.realpath(path), torch_dtype)
        if key not in parsed:
            parsed[key] = load(path, return_tensors=False, torch_dtype=torch_dtype)
        return {**parsed[key], "config": copy.deepcopy(parsed[key]["config"])}  # the part callers edit

    gguf.GGUFReader = shared_reader
    hf_gguf.load_gguf_checkpoint = load_once
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map = reader_class, load, name_map
