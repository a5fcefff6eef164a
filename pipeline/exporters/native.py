"""export.exporter=native: our own route. torch.export of the wrapped (quantized) module with the token dimension
bounded by the prefill chunk, then the backend's partitioning and one runner-layout program, model.pte, with the
constant methods a runner reads (pipeline/abi.py, plus the cache mode's own).

    python -m pipeline recipe=tiny_llama_xnnpack
    python -m pipeline recipe=tiny_llama_xnnpack backend=portable
"""
from __future__ import annotations

import json

import torch

from pipeline import abi, ops
from pipeline.backends import BACKENDS, logits_mode as resolve_logits_mode
from pipeline.config import v
from pipeline.exporters import handoff
from pipeline.model import adapter
from pipeline.model.cache_modes import CACHE_MODES, flags
from pipeline.model.layers.lora import FOUNDATION_TAG, attach_adapter
from pipeline.model.quant.smoothing import SCALES_FILE
from pipeline.report.progress import spinner
from pipeline.runtimes.executorch import load_kernels
from pipeline.store.files import sha256_file, write_streaming

# peak RSS of export and lower, as pipeline/preflight.py's STAGE_PEAK (memory estimates) reads it
NATIVE_RUNNER = True  # one runner-layout program: the C++ runners run it
STAGE_PEAK = {"export": {"module": 1.18, "embedding": 0.9, "layers": 0.9, "float": 0.7},
              "lower": {"module": 2.45, "layers": 1.35, "float": 1.2}}
PROGRAM = "model.pte"
MATMUL_OPS = ("aten_linear_default", "aten_mm_default", "aten_addmm_default")


class LoweringRefused(RuntimeError):
    """The lowered program would run, but not as the backend is meant to run it."""


def problems(cfg) -> list:
    return []


def geometry_problems(cfg, g) -> list:
    return []


# --- export ---------------------------------------------------------------------------------------------------

def export_program(module, chunk: int, strict: bool = True, logits_mode: str = "last"):
    """forward(tokens Long[1, T], positions Long[T]) with 1 <= T <= chunk; logits mode `selected` adds
    rows Long[R], 1 <= R <= chunk (the rows whose logits come back)."""
    t = min(2, chunk)
    example = (torch.zeros((1, t), dtype=torch.long), torch.arange(t, dtype=torch.long))
    dynamic = None
    if chunk > 1:
        T = torch.export.Dim("T", min=1, max=chunk)
        dynamic = ({1: T}, {0: T})
    if logits_mode == "selected":
        example += (torch.arange(t, dtype=torch.long),)
        if chunk > 1:
            dynamic += ({0: torch.export.Dim("R", min=1, max=chunk)},)
    from pipeline.exporters.lean_export import without_guard_cse
    with torch.no_grad(), without_guard_cse():
        return torch.export.export(module, example, dynamic_shapes=dynamic, strict=strict)


def strict_export(cfg) -> bool:
    """export.strict, or when it is null: non-strict (no dynamo: the same program bits, the default build's export
    20 -> 11 s) in fp32 where the backend lowers such a program and the cache mode's module exports to one; strict
    elsewhere (HF's static cache and MLX's quantized tensors fail to lower from a non-strict program)."""
    if cfg.export.strict is not None:
        return bool(cfg.export.strict)
    mode = CACHE_MODES[cfg.cache.mode]
    return not (BACKENDS[cfg.backend.name].LOWERS_NON_STRICT and mode.exports_non_strict(flags(cfg.cache))
                and v(cfg.export.dtype) == "fp32")


def export(ctx) -> dict:
    """Writes program.pt2 (torch.export.save)."""
    import torchao  # noqa: F401  (registers the quantized ops the program refers to)

    from pipeline.exporters.lean_export import without_canonical_self_test
    module = torch.load(ctx.inputs["quantize"] / "module.pt", weights_only=False)
    info = {}
    if ctx.cfg.export.fault is not None:  # a broken program on purpose: what the verify gate must catch
        from pipeline.model.layers.faults import inject
        info = {"fault": v(ctx.cfg.export.fault), "fault_detail": inject(module, v(ctx.cfg.export.fault))}
    separate = adapter.separate(ctx.cfg)
    if separate:  # the fine-tune's branches beside the quantized base (pipeline/model/layers/lora.py)
        info["adapter_branches"] = attach_adapter(module, ctx.cfg, ctx.inputs["quantize"] / SCALES_FILE)
    # fp32 only: there the program's bits are held the same, fused or not (a half program's text changed)
    fp32 = v(ctx.cfg.export.dtype) == "fp32"
    info["strict"] = strict = strict_export(ctx.cfg)
    # a mode whose programs call ExecuTorch's operators alone takes none of ours: no experts op (every expert as
    # plain linears over every row instead), no tied head
    ours = not CACHE_MODES[ctx.cfg.cache.mode].EXECUTORCH_OPS_ONLY
    if ours:
        info["expert_layers"] = BACKENDS[ctx.cfg.backend.name].pack_experts(module.model)
    else:
        from pipeline.model.layers.experts import dense_experts
        info["dense_expert_layers"] = dense_experts(module.model)
    # an adapter kept apart leaves the base's linears as they are: its foundation is the same for every adapter
    if ctx.cfg.export.fuse_projections and fp32 and not separate:
        from pipeline.model.layers.fused_projections import fuse_projections
        info["fused_projections"] = fuse_projections(module.model)
    if ctx.cfg.export.store_tied_once and BACKENDS[ctx.cfg.backend.name].RUNTIME == "executorch":
        from pipeline.model.layers.tied_head import store_tied_once
        if ours:
            info.update(store_tied_once(module.model))
        elif module.model.config.get_text_config().tie_word_embeddings:  # the summary says why it is stored twice
            from pipeline.model.layers.tied_head import shared_table
            table, why = shared_table(module.model)
            info.update(tied_head=False, tied_head_why=why if table is None else f"cache.mode={v(ctx.cfg.cache.mode)}: "
                        "ExecuTorch's operators alone, no llmpipe::tied_head")
    info.update(BACKENDS[ctx.cfg.backend.name].prepare(module, ctx.cfg))
    logits_mode = resolve_logits_mode(ctx.cfg)
    if logits_mode == "tail":
        from pipeline.model.layers.logits_rows import head_on_rows
        head_on_rows(module.model)
    with spinner("torch.export", ctx.progress):
        ep = export_program(module, ctx.cfg.export.prefill_chunk, strict, logits_mode)
    del module
    with without_canonical_self_test():
        write_streaming(ctx.out / "program.pt2", lambda f: torch.export.save(ep, f))
    if BACKENDS[ctx.cfg.backend.name].LOWERS_PROGRAM_IN_MEMORY and fp32:
        handoff.keep(ctx.out / "program.pt2", ep)
    return {"graph_nodes": len(ep.graph.nodes), **info}


# --- lower ----------------------------------------------------------------------------------------------------

def runner_constants(ctx) -> dict:
    """The runner layout's constant methods for this build (pipeline/abi.py)."""
    e = ctx.cfg.export
    bos, eos = abi.special_ids(ctx.inputs["download"] / "model")
    return abi.constant_methods(context=e.max_context_len, chunk=e.prefill_chunk, vocab=ctx.geometry.vocab_size,
                                dtype=v(e.dtype), logits_mode=resolve_logits_mode(ctx.cfg), bos=bos, eos=eos,
                                build_hash=ctx.build_hash, chat=abi.chat_template_name(ctx.inputs["download"] / "model"),
                                tail_rows=e.tail_rows)


def constant_methods(ctx) -> dict:
    """The runner layout's constant methods and the cache mode's (off-graph: the cache geometry the runtime
    builds; custom: the in-graph rings, so a runner refuses rewinds below what they hold)."""
    from transformers import AutoConfig
    e = ctx.cfg.export
    text = AutoConfig.from_pretrained(ctx.inputs["download"] / "model").get_text_config()
    mode = CACHE_MODES[ctx.cfg.cache.mode]
    data = {abi.DATA_FILES: f"{FOUNDATION_TAG}.ptd"} if adapter.separate(ctx.cfg) else {}
    return {**runner_constants(ctx), abi.SDPA_WITH_KV_CACHE: mode.sdpa_with_kv_cache(flags(ctx.cfg.cache)),
            **mode.constant_methods(text, e.max_context_len, e.prefill_chunk, flags(ctx.cfg.cache)), **data}


# nodes outside a delegate that run no kernel (tuple unpacking, shape reads)
NOT_KERNELS = ("getitem", "sym_size", "sym_numel", "sym_stride")


def delegation_report(edge) -> dict:
    """Delegation by op, and what one forward (one decoded token) executes: each delegated subgraph is one
    delegate call, each other node with a kernel one portable (or custom) op."""
    from executorch.devtools.backend_debug import get_delegation_info
    info = get_delegation_info(edge.exported_program().graph_module)
    portable = sum(b.non_delegated for op, b in info.delegation_by_operator.items() if op not in NOT_KERNELS)
    return {
        "delegated_subgraphs": info.num_delegated_subgraphs,
        "delegated_nodes": info.num_delegated_nodes,
        "non_delegated_nodes": info.num_non_delegated_nodes,
        "delegate_calls": info.num_delegated_subgraphs,
        "portable_ops": portable,
        "by_op": {op: {"delegated": b.delegated, "non_delegated": b.non_delegated}
                  for op, b in sorted(info.delegation_by_operator.items())},
    }


def lower_program(ep, cfg, methods: dict):
    """Edge dialect, the backend's partitioning, to_executorch; returns (program manager, delegation report)."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from pipeline.exporters.lean_edge import decompose_for, lean_edge
    load_kernels()  # out variants of the quantized_decomposed ops left outside the delegate
    backend = BACKENDS[cfg.backend.name]
    partitioners, passes = backend.partition()
    config = backend.executorch_config(cfg)
    if adapter.separate(cfg):  # the base's constants to foundation.ptd, delegated (tagged here) or not
        from pipeline.model.layers.lora import in_foundation, tag_delegate_constants
        passes = [*passes, tag_delegate_constants]
        config.external_constants = in_foundation
    with lean_edge():
        with backend.lowering():
            edge = to_edge_transform_and_lower(
                decompose_for(ep, partitioners), partitioner=partitioners, transform_passes=passes,
                constant_methods=methods, compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                                           _skip_dim_order=True))
        report = delegation_report(edge)
        if backend.DELEGATES_MATMULS:
            refuse_undelegated_matmuls(report, v(cfg.export.dtype), v(cfg.backend.name))
        return edge.to_executorch(config), report


def refuse_undelegated_matmuls(report: dict, dtype: str, backend: str) -> None:
    """A half-precision matmul outside the delegate runs on a portable kernel (a scalar loop, ~100x slower): the
    partitioner did not take the dtype, and the program is refused rather than shipped slow (fp32 linears that
    stay outside on purpose, e.g. group-wise weight-only ones, are the quantize stage's warning)."""
    outside = {op: b["non_delegated"] for op, b in report["by_op"].items() if op in MATMUL_OPS and b["non_delegated"]}
    if outside and dtype != "fp32":
        raise LoweringRefused(f"export.dtype={dtype}: {sum(outside.values())} matmuls fell outside the {backend} "
                              f"delegate ({outside}) and would run on portable kernels")


def register_program_ops(cfg) -> None:
    """The custom ops an exported program may call, registered for torch.export.load in a process that did not export
    it (export a cache hit, lower a miss): ours where their modules define them, the backend's (MLX), and ExecuTorch's
    llama:: ops (cache.mode=stock) by its custom_ops module."""
    from pipeline.model.layers import experts, tied_head  # noqa: F401  (define llmpipe::experts, llmpipe::tied_head)
    BACKENDS[cfg.backend.name].setup()
    ops.load([k for k in CACHE_MODES[cfg.cache.mode].KERNELS if k in ops.LIBRARIES and not ops.LIBRARIES[k].ours])


def lower(ctx) -> dict:
    """Writes model.pte and lower.json (the program record, the constant methods, delegation by op)."""
    import torchao  # noqa: F401  (the program refers to torchao's quantized ops)
    cfg = ctx.cfg
    program = ctx.inputs["export"] / "program.pt2"
    ep = handoff.take(program)
    if ep is None:
        register_program_ops(cfg)
        ep = torch.export.load(program)
    methods = constant_methods(ctx)
    with spinner(f"lower to {v(cfg.backend.name)}", ctx.progress):
        et, report = lower_program(ep, cfg, methods)
    pte = ctx.out / PROGRAM
    with open(pte, "wb") as f:
        et.write_to_file(f)
    data = write_data_files(et, ctx.out) if adapter.separate(cfg) else {}
    # the cache mode's kernels, and ours wherever the program calls an llmpipe op (a MoE layer's experts, a recurrent
    # layer's state ops: an in-place op shows in the edge report as auto_functionalized, so ask the program itself)
    called, delegates = ops.program_operators(et.executorch_program.execution_plan)
    req = ops.requirements(called, delegates)
    if req["needs_ours"] and CACHE_MODES[cfg.cache.mode].EXECUTORCH_OPS_ONLY:
        raise LoweringRefused(f"cache.mode={v(cfg.cache.mode)} promises ExecuTorch's operators alone, but the program "
                              f"calls ours: {sorted(op for op in called if ops.library(op).ours)}")
    ours = {"llmpipe"} if "llmpipe" in {ops.namespace(op) for op in called} else set()
    report["program"] = {"layout": "runner", "file": PROGRAM, "runtime": BACKENDS[cfg.backend.name].RUNTIME,
                         "kernels": sorted(set(CACHE_MODES[cfg.cache.mode].KERNELS) | ours),
                         **{k: data[k] for k in ("data", "data_sha256") if k in data}}
    report["constant_methods"] = methods
    report["deploy"] = {"operators": called, "delegates": delegates, **req,
                        "runners": runners(cfg)}
    (ctx.out / "lower.json").write_text(json.dumps(report, indent=2, default=lambda t: t.tolist()))
    return {"pte_bytes": pte.stat().st_size, **data, "deploy": report["deploy"],
            "delegated_nodes": report["delegated_nodes"],
            "non_delegated_nodes": report["non_delegated_nodes"],
            "delegated_subgraphs": report["delegated_subgraphs"], "delegate_calls": report["delegate_calls"],
            "portable_ops": report["portable_ops"], "delegation_by_op": report["by_op"]}


def write_data_files(et, out) -> dict:
    """The program's data files (an adapter kept apart: foundation.ptd, the base's weights), beside model.pte; their
    names and hashes for lower.json (a runner loads them with the program) and the manifest. A file another lower
    entry already holds, byte for byte (another adapter of the same base), becomes a hard link to it: the store keeps
    one foundation for all its adapters."""
    et.write_tensor_data_to_file(out)
    hashes = {f.name: sha256_file(f) for f in sorted(out.glob("*.ptd"))}
    shared = {name: share_identical(out / name, sha, out.parent) for name, sha in hashes.items()}
    return {"data": sorted(hashes), "data_sha256": hashes,
            "data_shared_with": {k: str(p) for k, p in shared.items() if p is not None}}


def share_identical(path, sha: str, entries):
    """Replace `path` with a hard link to the same file of another entry under `entries` whose manifest records this
    hash and whose bytes still have it; returns that file, or None."""
    import os

    from pipeline.store.files import read_manifest
    for entry in sorted(entries.iterdir()):
        other = entry / path.name
        m = (read_manifest(entry) if not entry.name.startswith(".") else None) or {}
        if m.get("status") != "ok" or (m.get("metrics") or {}).get("data_sha256", {}).get(path.name) != sha:
            continue
        if other.is_file() and other.stat().st_size == path.stat().st_size and sha256_file(other) == sha:
            tmp = path.with_suffix(".link")
            os.link(other, tmp)
            os.replace(tmp, path)
            return other
    return None


def runners(cfg) -> dict:
    """Which runners run this program: ours always (the Python runner; llm_runner where the backend's programs run in
    it), ExecuTorch's TextLLMRunner where forward takes (tokens, positions) and the cache is in the program; `why`
    says what keeps TextLLMRunner out."""
    backend, mode = BACKENDS[cfg.backend.name], CACHE_MODES[cfg.cache.mode]
    names = ["python -m pipeline generate"] + (["llm_runner"] if backend.NATIVE_RUNNER else [])
    if mode.RUNTIME_OWNED and backend.NATIVE_RUNNER:
        names.append("llm_batched_runner")
    logits = resolve_logits_mode(cfg)
    why = None
    if mode.RUNTIME_OWNED:
        why = (f"the KV cache is the runtime's (cache.mode={v(cfg.cache.mode)}): our runners create it and pass it to "
               "the program's ops")
    elif logits not in abi.TWO_INPUT_LOGITS_MODES:
        why = f"forward takes a third input, rows (export.logits_mode={logits}); TextLLMRunner passes two"
    elif not backend.NATIVE_RUNNER:
        why = f"its delegate (backend={v(cfg.backend.name)}) does not run on this machine"
    if why is None:
        names.append("TextLLMRunner")
    return {"runners": names, "text_llm_runner": why is None, "text_llm_runner_why": why}


def artifacts(entry) -> dict:
    """What the run manifest names for a lower entry of this route."""
    return {"pte": str(entry / PROGRAM)}
