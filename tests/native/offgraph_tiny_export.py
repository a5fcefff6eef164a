"""Exports tiny random offgraph programs (cache.mode=offgraph ABI), for tests/native/test_offgraph_native.py.

    python offgraph_tiny_export.py OUT_DIR

writes into OUT_DIR:
  og_llama.pte        Llama (2 layers, hidden 64, GQA 4/2), XNNPACK, logits 'last', chunk 8, context 96
  og_gemma3.pte       Gemma 3 (3 layers: sliding 16, sliding 16, full; 1 KV head), portable, logits 'last',
                      chunk 8, context 96
  og_gemma3_full.pte  the same Gemma 3 with logits 'full' (every row: the batched runner packs the decode
                      steps of several sessions into one forward)
  og_llama_full.pte   the same Llama with logits 'full', XNNPACK
  og_gemma3_selected.pte, og_llama_selected.pte  logits 'selected' (a third input, rows Long[R]: the batched
                      runner asks one row per decoding session), XNNPACK
Each program has no KV cache: every attention layer calls llmpipe::update_and_attend.out and the
runtime owns the cache (constant methods get_n_caches, get_kv_heads, get_head_dims, get_windows).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VOCAB = 128
CTX = 96
CHUNK = 8
WINDOW = 16
PROMPT_IDS = [1, 17, 33, 5, 90, 64, 12, 77, 3, 45, 101, 8, 60, 29, 14, 120, 9, 55, 71, 36, 18, 99, 42,
              6, 83, 27, 110, 50, 31, 11]  # 30 ids: past the window, several chunks
N_NEW = 16
EOS = [2]


def make_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX,
                      initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


def make_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=WINDOW,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=CTX, initializer_range=0.3, tie_word_embeddings=False)
    return Gemma3ForCausalLM(cfg).eval()


# name -> (model, backend, logits mode)
MODELS = {"og_llama": (make_llama, "xnnpack", "last"), "og_gemma3": (make_gemma3, "portable", "last"),
          "og_gemma3_full": (make_gemma3, "portable", "full"), "og_llama_full": (make_llama, "xnnpack", "full"),
          "og_gemma3_selected": (make_gemma3, "xnnpack", "selected"),
          "og_llama_selected": (make_llama, "xnnpack", "selected")}
LOGITS_MODE_CODES = {"full": 0, "last": 1, "selected": 2}


def wrapped(name: str):
    from pipeline.model.cache_modes.offgraph import OffgraphLM
    make, _, logits = MODELS[name]
    return OffgraphLM(make(), CTX, logits, prefill_chunk=CHUNK)


def export(name: str, out: Path) -> None:
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower

    from pipeline.exporters.native import export_program
    from pipeline.model.cache_modes import offgraph
    module = wrapped(name)
    _, backend, logits = MODELS[name]
    ep = export_program(module, CHUNK, strict=True, logits_mode=logits)  # `selected`: a third input, rows
    consts = dict(offgraph.constant_methods(module.model.config, CTX, CHUNK, offgraph.FLAGS[0]), get_max_context_len=CTX,
                  get_max_seq_len=CHUNK, get_vocab_size=VOCAB, get_activation_dtype=6,
                  get_logits_to_keep_mode=LOGITS_MODE_CODES[logits], get_bos_id=1, get_eos_ids=EOS,
                  get_recipe_hash=f"offgraph-{name}")
    partitioners = []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        partitioners = [XnnpackPartitioner()]
    edge = to_edge_transform_and_lower(ep, partitioner=partitioners, constant_methods=consts,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                                        _skip_dim_order=True))
    et = edge.to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True))
    out.write_bytes(et.buffer)


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        export(name, out / f"{name}.pte")
        print(f"[offgraph_tiny_export] {name}", file=sys.stderr, flush=True)
    (out / "done").write_text("ok")


if __name__ == "__main__":
    main(sys.argv[1])
