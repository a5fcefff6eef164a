"""The memory estimate preflight checks a build against: each stage's peak RSS and the KV cache's bytes, from the
model's geometry, never its weights."""
from __future__ import annotations

from pipeline.backends import BACKENDS
from pipeline.config import v
from pipeline.exporters import EXPORTERS
from pipeline.model.cache_modes import CACHE_MODES, flags
from pipeline.model.geometry import Geometry
from pipeline.model.kv.layout import geometry_layout, ring_slots
from pipeline.model.quant import resolve

# --------------------------------------------------------------------------------------------------
# Each stage's peak RSS (the build's own process, as the run
# manifest records it) = the process itself + coefficients x what it holds, in GiB per GiB: `weights` the fp32
# weights, `module` the quantized eager module, `embedding` the fp32 embedding table (the vocabulary's rows: the
# tokenizer, logits); `layers` GiB per 100 layers (the graph export and lowering trace); `float` the module's weights
# kept unquantized (lowering packs them again, the tied embedding twice). Fitted to the measured peaks of
# bench/scaling.py's three cold builds (random weights at SmolLM2-135M, gemma-3-270m and Llama-3.2-1B geometry,
# 8da4w; `--report` compares), `float` to the gemma-3-270m geometry's fp32 build (quantize=none: export 3.0, lower
# 4.3, verify 5.5 GiB), on an AVX-512 VNNI CPU, where the XNNPACK reference's 4-bit GEMM runs from
# int8 weights; elsewhere it holds them as fp32 (`fallback`: those 3 extra bytes a weight; the 1B's verify peaked at
# 16.0 GiB that way, 11.3 GiB native). Peaks vary a few percent run to run.
# export and lower are each exporter's (STAGE_PEAK); download depends on the source.
# --------------------------------------------------------------------------------------------------
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
PROCESS_GIB = 0.45  # python + torch + transformers + executorch, before any model
STAGE_PEAK = {"wrap": {"weights": 1.03},
              # the fp32 model, and with quantize.algorithm=gptq its Hessians (an estimate: not fitted)
              "calibrate": {"weights": 1.03, "hessians": 1.0},
              "quantize": {"weights": 1.01, "embedding": 3.63},
              "verify": {"weights": 1.8, "embedding": 3.0, "layers": 1.25, "float": 1.2, "fallback": 1.7}}
DOWNLOAD_PEAK = {"random": {"weights": 0.97, "embedding": 0.98},   # builds and saves the model
                 "gguf": {"weights": 2.0, "embedding": 0.98},      # dequantizes the file's tensors (a guess)
                 "hf": {}, "local": {}}                            # copies files


def embedding_parameters(g: Geometry) -> int:
    """The embedding tables' parameters: the token embedding and Gemma 4's per-layer input table (vocabulary x
    layers x per_layer_input), both nn.Embedding, both gathered, both quantized by the embedding scheme."""
    return g.vocab_size * (g.hidden_size + g.num_layers * g.per_layer_input)


def parameter_count(g: Geometry) -> int:
    """Every weight of the text model: its linears as geometry.linear_shapes() lists them (lm_head unless tied),
    the MoE routers, the norms and the embedding tables."""
    linears = sum(n_out * n_in for name, (n_out, n_in) in g.linear_shapes().items()
                  if name != "lm_head" or not g.tie_word_embeddings)
    return embedding_parameters(g) + linears + g.router_parameters() + g.recurrent_parameters() + \
        g.num_layers * 2 * g.hidden_size


def kv_cache_bytes(cfg, g: Geometry) -> int:
    """K/V storage at the recipe's context, in the export dtype, as the cache modes allocate it (the off-graph
    runtime at its default capacity, the context): one cache per layer that computes its own K/V (a KV-shared
    layer reads its source's), with that layer's heads and dims; the sliding layers of modes with rings hold
    window + chunk - 1 slots (at most the context), every other cache the whole context; plus the recurrent layers'
    state, whatever the context."""
    e = cfg.export
    rings = CACHE_MODES[cfg.cache.mode].rings(flags(cfg.cache))
    total = 0
    for s in geometry_layout(g).specs:
        slots = ring_slots(s.window if rings else 0, e.prefill_chunk, e.max_context_len)
        total += slots * s.kv_heads * (s.head_dim + s.v_dim) * DTYPE_BYTES[v(e.dtype)]
    return total + g.state_bytes(DTYPE_BYTES[v(e.dtype)])


def weight_bytes(scheme: str, group: int, dtype: str) -> float:
    """Bytes a weight takes in the eager module after quantize: torchao holds 4-bit values in int8 and each group
    adds a scale and a zero point; nvfp4 packs two values a byte with an fp8 scale per 16."""
    from pipeline.model.quant.schemes import SCHEMES
    return SCHEMES[scheme].module_bytes(group, DTYPE_BYTES[dtype])


def linear_parameters(g: Geometry, params: int) -> int:
    """The decoder layers' linear weights: all but the embedding tables and an lm_head of its own."""
    return params - embedding_parameters(g) - (0 if g.tie_word_embeddings else g.vocab_size * g.hidden_size)


def own_head(q, g: Geometry) -> bool:
    """Does the quantized module hold an lm_head of its own (not the embedding re-tied, not a float tied one)?"""
    retied = resolve.retied(q, g.tie_word_embeddings)
    float_tied = g.tie_word_embeddings and resolve.head(q).scheme == resolve.embedding(q).scheme == "none"
    return not retied and not float_tied


def module_parts(cfg, g: Geometry, params: int) -> list[tuple[int, str, int]]:
    """(weights, scheme, group) of the quantized eager module's parts: the linears, the embedding tables, an lm_head
    of its own. The linears' overrides count at the linears' scheme."""
    q = cfg.quantize
    parts = [(linear_parameters(g, params), v(q.linear), q.linear_group_size),
             (embedding_parameters(g), *resolve.embedding(q).pair)]
    if own_head(q, g):
        parts.append((g.vocab_size * g.hidden_size, *resolve.head(q).pair))
    return parts


def module_bytes(cfg, g: Geometry, params: int) -> int:
    """The quantized eager module's weight bytes, from the geometry and its parameter count."""
    dtype = v(cfg.export.dtype)
    return int(sum(n * weight_bytes(scheme, group, dtype) for n, scheme, group in module_parts(cfg, g, params)))


def float_bytes(cfg, g: Geometry, params: int) -> int:
    """The module's weight bytes kept unquantized (scheme none), in the export dtype."""
    dtype = v(cfg.export.dtype)
    return int(sum(n * weight_bytes(s, group, dtype) for n, s, group in module_parts(cfg, g, params) if s == "none"))


def fallback_bytes(cfg, g: Geometry, params: int) -> int:
    """What the same-quantization reference holds beyond its native path (the backend's reference_extra_bytes a
    weight of each part: XNNPACK's 8da4w where this CPU lacks the native 4-bit GEMM)."""
    extra = BACKENDS[cfg.backend.name].reference_extra_bytes
    return sum(n * extra(scheme, group) for n, scheme, group in module_parts(cfg, g, params))


def hessian_bytes(cfg, g: Geometry) -> int:
    """GPTQ's Hessians (fp32), one per distinct linear input of a dense layer: the attention's and the MLP's input,
    o's and down's; none without quantize.algorithm=gptq."""
    if v(cfg.quantize.algorithm) != "gptq":
        return 0
    shapes = g.linear_shapes()
    widths = {n_in for name, (_, n_in) in shapes.items() if name != "lm_head"}
    return 4 * g.num_layers * (3 * g.hidden_size ** 2 + sum(w * w for w in widths if w != g.hidden_size))


def memory_estimate(cfg, g: Geometry) -> dict:
    """Each stage's peak RSS in bytes (stage_peak_bytes), the largest (peak_bytes), and the KV cache's bytes."""
    params = parameter_count(g)
    module = module_bytes(cfg, g, params)
    held = {"weights": params * 4 / 2**30, "module": module / 2**30,
            "embedding": g.vocab_size * g.hidden_size * 4 / 2**30, "layers": g.num_layers / 100,
            "float": float_bytes(cfg, g, params) / 2**30, "fallback": fallback_bytes(cfg, g, params) / 2**30,
            "hessians": hessian_bytes(cfg, g) / 2**30}
    factors = {"download": DOWNLOAD_PEAK[v(cfg.model.source)], **STAGE_PEAK,
               **EXPORTERS[cfg.export.exporter].STAGE_PEAK}
    peaks = {stage: int((PROCESS_GIB + sum(c * held[k] for k, c in f.items())) * 2**30)
             for stage, f in factors.items()}
    return {"params": params, "weights_bytes": params * 4, "module_bytes": module,
            "stage_peak_bytes": peaks, "peak_bytes": max(peaks.values()),
            "kv_cache_bytes": kv_cache_bytes(cfg, g)}
