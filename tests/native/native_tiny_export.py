"""Exports tiny random programs with the pipeline's runner ABI, for the native tests.

    python native_tiny_export.py OUT_DIR

writes into OUT_DIR:
  tiny_last.pte   fp32 Llama (2 layers, hidden 64), logits 'last', chunk 16, context 96
  tiny_8da4w.pte  4-bit embedding + 8da4w linears (int8 dynamic activations, int4 weights,
                  group 32), logits 'last'
  no_consts.pte   a trivial program with no constant methods
  bad_consts.pte  a trivial program whose get_max_context_len is 0
  counter_*.pte   weightless programs predicting (last token + 1) % 64, Half/BFloat16/Float logits,
                  modes full/last/selected, EOS 60
  reference.json  greedy tokens from the ExecuTorch Python runtime for PROMPT_IDS on each LLM program

The KV cache lives in the program as mutable buffers (transformers' static cache
wrapper); forward(tokens [1,T], positions [T]) with 1 <= T <= chunk.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

VOCAB = 49152  # SmolLM2's tokenizer size, so the real tokenizer fits
CTX = 96
CHUNK = 16
PROMPT_IDS = [1, 504, 3458, 282, 4649, 30, 198, 1205, 314, 253, 3158, 28, 42, 7, 9, 1000,
              2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 11000]  # 26 > CHUNK
N_NEW = 20


def _constants(logits_mode: int) -> dict:
    return {"get_max_context_len": CTX, "get_max_seq_len": CHUNK, "get_vocab_size": VOCAB,
            "get_activation_dtype": 6, "get_logits_to_keep_mode": logits_mode, "get_bos_id": 1,
            "get_eos_ids": [2, 0], "get_recipe_hash": "tiny-test-recipe"}


def _llm(quant: str | None):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX,
                      tie_word_embeddings=False, initializer_range=0.3)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": CTX})
    if quant == "8da4w":
        # like the pipeline's 8da4w recipes: 4-bit embedding first, then 8da4w linears
        from torchao.quantization import (Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig,
                                          quantize_)
        from torchao.quantization.granularity import PerGroup

        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Embedding))
        quantize_(model, Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32)))
    return model


def _export_llm(out: Path, logits_mode: int, quant: str | None = None) -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    inner = TorchExportableModuleWithStaticCache(_llm(quant), batch_size=1, max_cache_len=CTX)
    last = logits_mode == 1

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, tokens, positions):
            logits = self.inner(input_ids=tokens, cache_position=positions)
            return logits[:, -1:, :] if last else logits

    t = torch.export.Dim("T", min=1, max=CHUNK)
    example = (torch.tensor([[1, 2]], dtype=torch.long), torch.tensor([0, 1], dtype=torch.long))
    with torch.no_grad():
        ep = torch.export.export(Wrapper().eval(), example, dynamic_shapes=({1: t}, {0: t}),
                                 strict=True)
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()],
                                       constant_methods=_constants(logits_mode))
    # quant fusion turns the embedding's dequantize into quantized_decomposed::embedding_4bit,
    # which runs outside the delegate (libexecutorch_kernels_quantized in the runner)
    prog = edge.to_executorch(ExecutorchBackendConfig(
        run_reinplace_pass=True, do_quant_fusion_and_const_prop=quant is not None))
    out.write_bytes(prog.buffer)


def _export_trivial(out: Path, constants: dict | None) -> None:
    from executorch.exir import to_edge

    class Tiny(torch.nn.Module):
        def forward(self, tokens, positions):
            return (tokens + positions).float().unsqueeze(-1)

    ep = torch.export.export(Tiny(), (torch.ones(1, 2, dtype=torch.long),
                                      torch.ones(2, dtype=torch.long)))
    kwargs = {"constant_methods": constants} if constants else {}
    out.write_bytes(to_edge(ep, **kwargs).to_executorch().buffer)


COUNTER_VOCAB = 64
COUNTER_EOS = 60


def _export_counter(out: Path, dtype: torch.dtype, logits_mode: int) -> None:
    """A weightless program whose greedy next token is (last token + 1) % 64: checks logits
    dtypes (Half / BFloat16), the three logits modes and stopping on an EOS id, in seconds."""
    import torch.nn.functional as F
    from executorch.exir import to_edge

    vocab, ctx, chunk = COUNTER_VOCAB, 64, 8

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("eye", torch.eye(vocab, dtype=dtype) * 3)

        def forward(self, tokens, positions):
            logits = F.embedding((tokens + 1) % vocab, self.eye)
            return logits[:, -1:, :] if logits_mode == 1 else logits

    class Selected(Counter):
        def forward(self, tokens, positions, rows):
            return super().forward(tokens, positions).index_select(1, rows)

    t = torch.export.Dim("T", min=1, max=chunk)
    example = (torch.tensor([[1, 2]]), torch.tensor([0, 1]))
    shapes = ({1: t}, {0: t})
    if logits_mode == 2:
        example, shapes = example + (torch.tensor([1]),), shapes + (None,)
    ep = torch.export.export(Selected() if logits_mode == 2 else Counter(), example, dynamic_shapes=shapes)
    code = {torch.float16: 5, torch.bfloat16: 15, torch.float32: 6}[dtype]
    constants = {"get_max_context_len": ctx, "get_max_seq_len": chunk, "get_vocab_size": vocab,
                 "get_activation_dtype": code, "get_logits_to_keep_mode": logits_mode, "get_bos_id": 1,
                 "get_eos_ids": [COUNTER_EOS], "get_recipe_hash": 12345}
    out.write_bytes(to_edge(ep, constant_methods=constants).to_executorch().buffer)


def python_greedy(pte: Path, prompt: list[int], n_new: int, chunk: int = CHUNK) -> list[int]:
    """Greedy decoding with the ExecuTorch Python runtime (chunked prefill like the runner)."""
    import executorch.kernels.quantized  # noqa: F401  (quantized_decomposed:: kernels for Python)
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(pte)).load_method("forward")
    pos = 0
    logits = None
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        logits = method.execute([torch.tensor([part], dtype=torch.long),
                                 torch.arange(pos, pos + len(part), dtype=torch.long)])[0]
        pos += len(part)
    out = []
    for _ in range(n_new):
        tok = int(torch.argmax(logits[0, -1].float()))
        out.append(tok)
        if len(out) == n_new:
            break
        logits = method.execute([torch.tensor([[tok]], dtype=torch.long),
                                 torch.tensor([pos], dtype=torch.long)])[0]
        pos += 1
    return out


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def step(what):
        print(f"[tiny_export] {what}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)

    _export_trivial(out / "no_consts.pte", None)
    bad = _constants(1)
    bad["get_max_context_len"] = 0
    _export_trivial(out / "bad_consts.pte", bad)
    _export_counter(out / "counter_half_full.pte", torch.float16, 0)
    _export_counter(out / "counter_bf16_last.pte", torch.bfloat16, 1)
    _export_counter(out / "counter_fp32_selected.pte", torch.float32, 2)
    step("trivial programs")
    _export_llm(out / "tiny_last.pte", 1)
    step("tiny_last")
    _export_llm(out / "tiny_8da4w.pte", 1, quant="8da4w")
    step("tiny_8da4w")
    ref = {"prompt_ids": PROMPT_IDS, "n_new": N_NEW}
    for name in ("tiny_last", "tiny_8da4w"):
        ref[name] = python_greedy(out / f"{name}.pte", PROMPT_IDS, N_NEW)
    step("python references")
    (out / "reference.json").write_text(json.dumps(ref))


if __name__ == "__main__":
    main(sys.argv[1])
