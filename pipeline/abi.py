"""The .pte contract between the builder and every runtime that runs a program (ours, the C++ runners, and
ExecuTorch's own LLM runner, TextLLMRunner).

- The runner layout: `forward(tokens Long[1, T], positions Long[T]) -> logits [1, R, V]`, 1 <= T <= chunk;
  R = 1 (logits mode `last`), T (`full`) or min(T, get_tail_rows) (`tail`: the step's last rows). Logits mode
  `selected` takes a third input, `forward(tokens, positions, rows Long[R]) -> [1, R, V]` (those rows, in order):
  ExecuTorch's runner passes two inputs and cannot drive it.
- The constant methods every program publishes (their names and codes are below), ExecuTorch's runner's among them,
  and the special token ids.
- ExecuTorch ScalarType codes, one table for every module that reads or writes them.

A leaf module: the stages, the exporters and the runtimes import it; it imports nothing of the pipeline.
"""
from __future__ import annotations

import torch

# ExecuTorch ScalarType codes (runtime/core/portable_type/scalar_type.h) of the dtypes programs use
SCALAR_TYPES: dict[int, torch.dtype] = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
    6: torch.float32, 11: torch.bool, 15: torch.bfloat16, 28: torch.uint32,
}
SCALAR_TYPE_CODES: dict[torch.dtype, int] = {t: c for c, t in SCALAR_TYPES.items()}
INT64 = SCALAR_TYPE_CODES[torch.int64]

# the config's activation dtypes (export.dtype, verify.runtime.kv_storage_dtype)
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, str] = {t: n for n, t in DTYPES.items()}
# K/V storage (cache.kv_dtype, verify.runtime.kv_storage_dtype, --kv-storage-dtype): int8 and int4 rows carry their
# scales (pipeline/model/kv/quant.py; int4 rows live in uint8 buffers)
KV_DTYPES: dict[str, torch.dtype] = {**DTYPES, "int8": torch.int8, "int4": torch.uint8}
KV_DTYPE_NAMES: dict[torch.dtype, str] = {t: n for n, t in KV_DTYPES.items()}

# get_logits_to_keep_mode
LOGITS_MODE_CODES = {"full": 0, "last": 1, "selected": 2, "tail": 3}
# the modes whose forward takes (tokens, positions) only: what ExecuTorch's TextLLMRunner passes
TWO_INPUT_LOGITS_MODES = ("full", "last", "tail")

# the constant methods of the runner layout; cache modes add their own (get_n_caches, get_ring_windows, ...)
MAX_CONTEXT_LEN = "get_max_context_len"
MAX_SEQ_LEN = "get_max_seq_len"          # the prefill chunk: the largest T of one forward
VOCAB_SIZE = "get_vocab_size"
ACTIVATION_DTYPE = "get_activation_dtype"
LOGITS_MODE = "get_logits_to_keep_mode"
BOS_ID = "get_bos_id"
EOS_IDS = "get_eos_ids"
RECIPE_HASH = "get_recipe_hash"
CHAT_TEMPLATE = "get_chat_template"      # the model's chat template by name (the runners' --chat default)
TAIL_ROWS = "get_tail_rows"              # logits mode `tail`: the most rows a forward returns
# the data files forward reads its constants from, comma-separated (an adapter kept apart: "foundation.ptd"); the
# runners look for them beside the .pte unless told where (--data)
DATA_FILES = "get_data_files"
# ExecuTorch's LLM runner reads these (extension/llm/runner/constants.h; missing ones it logs and guesses)
USE_KV_CACHE = "use_kv_cache"            # forward takes the positions: a cache keeps the earlier tokens
SDPA_WITH_KV_CACHE = "use_sdpa_with_kv_cache"  # attention is one custom op over the cache (a cache mode's answer)
DYNAMIC_SHAPE = "enable_dynamic_shape"   # forward takes 1..chunk tokens (else one at a time)

# the C++ runners' chat templates (native/src/runtime/chat_template.cpp) and the special token that tells each
# apart in an HF chat template; "0" = raw text (no template)
CHAT_TEMPLATE_MARKERS = {"gemma4": "<|turn>", "gemma": "<start_of_turn>", "llama3": "<|start_header_id|>",
                         "chatml": "<|im_start|>"}
RAW_CHAT = "0"


def constant_methods(*, context: int, chunk: int, vocab: int, dtype: str, logits_mode: str, bos: int,
                     eos: list[int], build_hash: str, chat: str = RAW_CHAT, tail_rows: int = 1) -> dict:
    """The constant methods every runner-layout program carries (`chat`: chat_template_name's answer; `tail_rows`:
    logits mode `tail`'s most rows). The cache mode adds use_sdpa_with_kv_cache."""
    methods = {
        MAX_CONTEXT_LEN: int(context),
        MAX_SEQ_LEN: int(chunk),
        VOCAB_SIZE: int(vocab),
        ACTIVATION_DTYPE: SCALAR_TYPE_CODES[DTYPES[dtype]],
        LOGITS_MODE: LOGITS_MODE_CODES[logits_mode],
        BOS_ID: int(bos),
        EOS_IDS: [int(i) for i in eos],
        RECIPE_HASH: build_hash,
        CHAT_TEMPLATE: chat,
        USE_KV_CACHE: True,
        DYNAMIC_SHAPE: int(chunk) > 1,
    }
    if logits_mode == "tail":
        methods[TAIL_ROWS] = min(int(tail_rows), int(chunk))
    return methods


def chat_template_name(model_dir) -> str:
    """Which of the runners' chat templates the model's HF chat template is (told apart by its turn tokens),
    RAW_CHAT when it has none or one the runners do not know."""
    from transformers import AutoTokenizer
    template = AutoTokenizer.from_pretrained(model_dir).chat_template or ""
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default") or next(iter(template.values()), "")
    for name, marker in CHAT_TEMPLATE_MARKERS.items():
        if marker in template:
            return name
    return RAW_CHAT


def special_ids(model_dir) -> tuple[int, list[int]]:
    """BOS id (-1 if none) and the EOS id set, from the model's config, generation config and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    cfg = AutoConfig.from_pretrained(model_dir).get_text_config()
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos: list[int] = []
    sources = [cfg.eos_token_id, tok.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:
        pass
    for e in sources:
        for i in (e if isinstance(e, (list, tuple)) else [e]):
            if i is not None and i not in eos:
                eos.append(int(i))
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else tok.bos_token_id
    return (int(bos) if bos is not None else -1), eos


def ints(x) -> list[int]:
    """A constant method's value (a scalar, a list or a tensor, as each runtime returns it) as ints."""
    if isinstance(x, torch.Tensor):
        return [int(i) for i in x.reshape(-1).tolist()]
    if isinstance(x, (list, tuple)):
        return [int(i) for i in x]
    return [int(x)]
