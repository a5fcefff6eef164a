"""lower: edge dialect, backend partitioning and the .pte, with the constant methods a runner reads.

    python -m pipeline recipe=tiny_llama_xnnpack backend=portable

Backends live in BACKENDS (xnnpack, portable, mlx). Writes model.pte and lower.json
(delegated vs non-delegated op counts, by op).
"""
from __future__ import annotations

import json
import logging

import torch

from pipeline import modeling
from pipeline.config import v
from pipeline.progress import spinner

NAME, VERSION = "lower", 1
AFTER = ("download", "export")
CONFIG_KEYS = ("backend",)
SOURCES = ("pipeline/backends",)  # backend-specific module rewrites and partitioner configs
SOURCES += ("pipeline/hf_exporter.py",)  # export.exporter=transformers

log = logging.getLogger(__name__)


def _xnnpack():
    # the stock partitioner silently drops weight-only scales; see pipeline/backends/xnnpack_woq.py
    from pipeline.backends.xnnpack_woq import partitioner, split_weight_only_linear_bias
    return [partitioner()], [split_weight_only_linear_bias]


def _mlx():
    from pipeline.backends.mlx import partitioners_and_passes
    return partitioners_and_passes()


BACKENDS = {"xnnpack": _xnnpack, "portable": lambda: ([], []), "mlx": _mlx}


def special_ids(model_dir) -> tuple[int, list[int]]:
    """BOS id and the EOS id set, from the model's config, generation config and tokenizer."""
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


def constant_methods(ctx) -> dict:
    e, g = ctx.cfg.export, ctx.geometry
    bos, eos = special_ids(ctx.inputs["download"] / "model")
    methods = {
        "get_max_context_len": int(e.max_context_len),
        "get_max_seq_len": int(e.prefill_chunk),
        "get_vocab_size": int(g.vocab_size),
        "get_activation_dtype": modeling.SCALAR_TYPE_CODES[v(e.dtype)],
        "get_logits_to_keep_mode": modeling.LOGITS_MODE_CODES[v(e.logits_mode)],
        "get_bos_id": bos,
        "get_eos_ids": eos,
        "get_recipe_hash": ctx.build_hash,
    }
    mode = v(ctx.cfg.cache.mode)
    if mode in ("offgraph", "custom"):
        from transformers import AutoConfig

        from pipeline import custom_cache, offgraph
        cfg = AutoConfig.from_pretrained(ctx.inputs["download"] / "model").get_text_config()
        if mode == "offgraph":  # the runtime-owned cache's geometry
            methods.update(offgraph.constant_methods(cfg))
        else:  # the in-graph rings, so that a runner refuses rewinds below what they hold
            methods.update(custom_cache.constant_methods(cfg, e.max_context_len, e.prefill_chunk))
    return methods


def delegation_report(edge) -> dict:
    from executorch.devtools.backend_debug import get_delegation_info
    info = get_delegation_info(edge.exported_program().graph_module)
    return {
        "delegated_subgraphs": info.num_delegated_subgraphs,
        "delegated_nodes": info.num_delegated_nodes,
        "non_delegated_nodes": info.num_non_delegated_nodes,
        "by_op": {op: {"delegated": b.delegated, "non_delegated": b.non_delegated}
                  for op, b in sorted(info.delegation_by_operator.items())},
    }


def lower(ep, backend: str, methods: dict, quant_fusion: bool):
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower

    from pipeline.runtime import load_kernels
    load_kernels()  # out variants of the quantized_decomposed ops left outside the delegate
    partitioners, passes = BACKENDS[backend]()
    edge = to_edge_transform_and_lower(
        ep, partitioner=partitioners, transform_passes=passes, constant_methods=methods,
        compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True))
    report = delegation_report(edge)
    if backend == "mlx":  # the compile config of the delegate's LLM example
        from pipeline.backends.mlx import backend_config
        return edge.to_executorch(backend_config()), report
    et = edge.to_executorch(ExecutorchBackendConfig(
        run_reinplace_pass=True, do_quant_fusion_and_const_prop=quant_fusion))
    return et, report


def run(ctx) -> dict:
    # --- export.exporter=transformers: already lowered by the exporter; publish the pair (pipeline/hf_exporter.py) ---
    if v(ctx.cfg.export.exporter) == "transformers":
        from pipeline import hf_exporter
        return hf_exporter.lower_stage(ctx)
    # --- end export.exporter=transformers ---
    import torchao  # noqa: F401  (the program refers to torchao's quantized ops)
    ep = torch.export.load(ctx.inputs["export"] / "program.pt2")
    methods = constant_methods(ctx)
    backend = v(ctx.cfg.backend.name)
    with spinner(f"lower to {backend}", ctx.progress):
        et, report = lower(ep, backend, methods, ctx.cfg.backend.quant_fusion)
    pte = ctx.out / "model.pte"
    with open(pte, "wb") as f:
        et.write_to_file(f)
    report["constant_methods"] = methods
    (ctx.out / "lower.json").write_text(json.dumps(report, indent=2, default=lambda t: t.tolist()))
    return {"pte_bytes": pte.stat().st_size, "delegated_nodes": report["delegated_nodes"],
            "non_delegated_nodes": report["non_delegated_nodes"],
            "delegated_subgraphs": report["delegated_subgraphs"], "delegation_by_op": report["by_op"]}
