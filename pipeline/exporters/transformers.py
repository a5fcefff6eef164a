"""export.exporter=transformers: the transformers.exporters route, the export and lower stages' work.

    python -m pipeline recipe=tiny_llama_hf_exporter
    python -m pipeline recipe=smollm2_xnnpack_hf_exporter

transformers 5.22+ ships `transformers.exporters.ExecutorchExporter`. It captures a model's prefill and decode
forwards from a real `generate()` and exports each as its own ExecuTorch program (torch.export with its own
patches, non-strict, then lowered inside the same call), the KV cache (a `StaticCache`) passed in and returned as
program inputs and outputs. Around it, everything is ours: the same download/wrap/quantize entries as the native
route (the wrapped eager modules stay verify's references), the stage cache, the manifests, verify.

- export: the quantize stage's eager model is handed over (quantization is ours, torchao, not the exporter's
  quantizer), after the module rewrites its backend needs (BACKENDS[name].handover: on xnnpack, weight-only
  linears in the forms it runs correctly and quantized embeddings as ops with out variants). Writes prefill.pte,
  decode.pte, export.json (the exporter's own manifest: the pytree specs of each program's inputs and outputs),
  config.json, generation_config.json, and hf_export.json (ours: shapes, quantization handed over, delegation).
- lower: the exporter already lowered; links the pair into its entry (so that entry is a complete
  `ExportedModel.from_pretrained` folder) beside lower.json, which records what the native route bakes into its
  program as constant methods (EOS ids, context, chunk, ...): these programs carry none.

backend=mlx: the exporter's mlx backend refuses a StaticCache, so the capture runs generate() over a DynamicCache
(prefill.pte takes no cache and returns each layer's K/V; decode.pte takes the K/V so far, a dynamic length
1..context-1, and returns them grown by the new tokens), nothing is rewritten before the handover (the MLX
partitioner lowers torchao's tensors itself), and the whole graph lands in the MLX delegate.

Verify runs the pair through pipeline/runtimes/pair.py in the backend's runtime. The C++ runner does not know this
layout: `problems` below refuses verify.native=true, with what else this route cannot build.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from pipeline import ops
from pipeline.backends import BACKENDS
from pipeline.config import v
from pipeline.exporters.native import runner_constants
from pipeline.model import adapter
from pipeline.report.progress import spinner
from pipeline.runtimes.executorch import load_kernels

log = logging.getLogger(__name__)

# the exporter's xnnpack backend lowers from a StaticCache capture; its mlx backend refuses one: a DynamicCache
# peak RSS of export and lower, as pipeline/preflight.py's STAGE_PEAK: SmolLM2 fp32 (prefill then decode, one
# model alive at a time) 4.3 GiB
NATIVE_RUNNER = False  # prefill.pte + decode.pte: the C++ runners run the native route's one program
STAGE_PEAK = {"export": {"weights": 8.5}, "lower": {"weights": 8.5}}
COMPONENTS = ("prefill", "decode")
# files of an exporter folder that the lower entry carries (ExportedModel.from_pretrained reads them)
FOLDER_FILES = ("prefill.pte", "decode.pte", "export.json", "config.json", "generation_config.json")
# the token axis of each per-token input the exporter captures (attention_mask: the decode's 4D [1, 1, T, context])
TOKEN_AXIS = {"input_ids": 1, "position_ids": 1, "attention_mask": 2}


def handover_model(quantized_module_path: Path, q, backend: str) -> tuple[nn.Module, dict]:
    """The quantize stage's HF model, rewritten for the exporter by the backend; returns it and what was done."""
    module = torch.load(quantized_module_path, weights_only=False)
    model = module.model  # the wrapper's static cache buffers stay behind: the exporter brings its own cache
    del module
    done = {"applied_by": "pipeline quantize stage (torchao), before the handover", "exporter_quantizer": None,
            "linear": v(q.linear), "embedding": v(q.embedding), "linear_forms": {}, "quantized_embeddings": 0}
    done.update(BACKENDS[backend].handover(model, q))
    for m in model.modules():
        m.__dict__.pop("extra_repr", None)  # torchao's per-instance partial
    model.eval()
    return model, done


# --- export ---------------------------------------------------------------------------------------------------

def generation_config(model, context: int, backend: str = "xnnpack"):
    """Greedy generate() over a static cache of the full context (the decode program then takes a fixed-size cache),
    or for mlx over a dynamic cache (the decode program takes the cache so far, of any length)."""
    from transformers import GenerationConfig
    cfg = model.config.get_text_config()
    eos = cfg.eos_token_id
    static = BACKENDS[backend].HANDOVER_CACHE == "StaticCache"
    cache = {"cache_implementation": "static", "max_cache_len": context} if static else \
        {"cache_implementation": "dynamic"}
    return GenerationConfig(**cache, do_sample=False,
                            pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else
                            (eos[0] if isinstance(eos, list) else eos), eos_token_id=eos)


def sample_prompt(chunk: int, vocab: int) -> torch.Tensor:
    # >= 2 tokens so the token axis is traced symbolic; any ids do, generate() only has to run
    n = min(chunk, 4)
    return (torch.arange(n, dtype=torch.long) % max(vocab - 3, 1) + 3)[None]


def dynamic_shapes(inputs: dict, tokens, past=None) -> dict:
    """The token axis varies (1..prefill_chunk); a StaticCache keeps its full-context shape, a DynamicCache's
    K/V [1, Hkv, S, D] vary in S (`past`: the positions before the call)."""
    from transformers.cache_utils import Cache, DynamicCache
    from transformers.exporters.exporter_dynamo import get_auto_dynamic_shapes
    out = {}
    for name, value in inputs.items():
        if isinstance(value, DynamicCache):  # one spec per cache leaf (none for the prefill's empty cache)
            leaves = get_auto_dynamic_shapes(value)
            if leaves and past is None:
                raise RuntimeError("a DynamicCache input needs a `past` dim")
            out[name] = [{2: past} for _ in leaves]
        elif isinstance(value, Cache):  # one spec per cache leaf, all static
            out[name] = torch.utils._pytree.tree_map(lambda _: None, get_auto_dynamic_shapes(value))
        elif isinstance(value, torch.Tensor):
            if name not in TOKEN_AXIS:
                raise RuntimeError(f"the exporter captured an input {name!r} this route does not know "
                                   f"(known: {sorted(TOKEN_AXIS)} and the cache)")
            out[name] = {TOKEN_AXIS[name]: tokens}
        # bools (use_cache, return_dict) are output flags the exporter pops before tracing
    return out


def delegation(program) -> dict:
    """Delegated vs not, by op. The exporter hands back the program after to_executorch (the native route counts
    the edge program), so memory planning's `alloc` nodes are left out to keep the figures comparable."""
    from executorch.devtools.backend_debug import get_delegation_info
    info = get_delegation_info(program.exported_program().graph_module)
    by_op = {op: {"delegated": b.delegated, "non_delegated": b.non_delegated}
             for op, b in sorted(info.delegation_by_operator.items()) if op != "alloc"}
    return {"delegated_subgraphs": info.num_delegated_subgraphs,
            "delegated_nodes": sum(b["delegated"] for b in by_op.values()),
            "non_delegated_nodes": sum(b["non_delegated"] for b in by_op.values()), "by_op": by_op}


def export(ctx) -> dict:
    import torchao  # noqa: F401  (registers the quantized ops a torchao model traces to)
    from transformers.exporters import ExecutorchConfig, ExecutorchExporter, ExportedModel
    from transformers.exporters.utils import decompose_for_generation

    load_kernels()  # out variants of the quantized_decomposed ops left outside the delegate

    e, backend = ctx.cfg.export, v(ctx.cfg.backend.name)
    BACKENDS[backend].setup()
    path = ctx.inputs["quantize"] / "module.pt"
    model, quant = handover_model(path, ctx.cfg.quantize, backend)
    gen = generation_config(model, e.max_context_len, backend)
    prompt = sample_prompt(e.prefill_chunk, model.config.get_text_config().vocab_size)
    with spinner("capture prefill/decode from generate()", ctx.progress), torch.no_grad():
        parts = decompose_for_generation(model, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)},
                                         generation_config=gen, multi_token_decode=True)
    if tuple(parts) != COMPONENTS:
        raise RuntimeError(f"the exporter decomposed the model into {list(parts)}; this route runs {list(COMPONENTS)}")
    tokens = torch.export.Dim("tokens", min=1, max=e.prefill_chunk)
    # DynamicCache (mlx): decode runs after at least one token and before the context is full
    past = torch.export.Dim("past", min=1, max=e.max_context_len - 1)
    exporter = ExecutorchExporter()
    components, report = {}, {"backend": backend, "components": {}}
    for i, name in enumerate(COMPONENTS):
        _, inputs = parts[name]
        shapes = dynamic_shapes(inputs, tokens, past)
        config = ExecutorchConfig(backend=backend, dynamic_shapes=shapes, strict=bool(e.strict),
                                  prefer_deferred_runtime_asserts_over_guards=True)
        if i > 0:
            # a model exported once cannot be exported again: the exporter's model.to("cpu") must swap its
            # torchao weights, which the first trace left weakly referenced ("Cannot swap t1 ...")
            del model
            gc.collect()
            model, _ = handover_model(path, ctx.cfg.quantize, backend)
        t0 = time.perf_counter()
        with spinner(f"export + lower {name} ({backend})", ctx.progress):
            components[name] = exporter.export(model, inputs, config).components["model"]
        report["components"][name] = {
            "seconds": round(time.perf_counter() - t0, 1),
            "inputs": {k: (list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__)
                       for k, t in inputs.items()},
            "dynamic_tokens": [1, e.prefill_chunk],
            **({"dynamic_past": [1, e.max_context_len - 1]}
               if name == "decode" and BACKENDS[backend].HANDOVER_CACHE == "DynamicCache" else {}),
            **delegation(components[name].program),
        }
    exported = ExportedModel(components, exporter.export_format, config=model.config, generation_config=gen)
    exported.save_pretrained(ctx.out)
    del exported, components, model
    gc.collect()
    report["quantization"] = quant
    report["exporter"] = {"class": "transformers.exporters.ExecutorchExporter", "strict": bool(e.strict),
                          "multi_token_decode": True, "cache": BACKENDS[backend].HANDOVER_CACHE,
                          "max_cache_len": e.max_context_len}
    (ctx.out / "hf_export.json").write_text(json.dumps(report, indent=2))
    sizes = {n: (ctx.out / f"{n}.pte").stat().st_size for n in COMPONENTS}
    return {"exporter": "transformers", "quantization": quant,
            **{f"{n}_pte_bytes": b for n, b in sizes.items()},
            **{f"{n}_seconds": report["components"][n]["seconds"] for n in COMPONENTS}}


# --- lower ----------------------------------------------------------------------------------------------------

def _link(src: Path, dst: Path) -> None:
    # cache entries are immutable once published, so a hard link is a safe, free copy
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def lower(ctx) -> dict:
    src = ctx.inputs["export"]
    for name in FOLDER_FILES:
        if (src / name).exists():
            _link(src / name, ctx.out / name)
    report = json.loads((src / "hf_export.json").read_text())
    comps = report["components"]
    lowered = {
        "layout": "prefill+decode (transformers.exporters), KV cache as program input/output",
        "cache": report["exporter"]["cache"],
        "program": {"layout": "prefill_decode", "files": {n: f"{n}.pte" for n in COMPONENTS},
                    "runtime": BACKENDS[ctx.cfg.backend.name].RUNTIME, "kernels": []},
        "programs": {n: {"file": f"{n}.pte", **{k: comps[n][k] for k in
                         ("delegated_subgraphs", "delegated_nodes", "non_delegated_nodes", "by_op")}}
                     for n in COMPONENTS},
        # these programs carry no constant methods: the values the native route bakes in, for verify and readers
        "constant_methods": runner_constants(ctx),
        "delegated_nodes": sum(comps[n]["delegated_nodes"] for n in COMPONENTS),
        "non_delegated_nodes": sum(comps[n]["non_delegated_nodes"] for n in COMPONENTS),
    }
    called, delegates = set(), set()
    for n in COMPONENTS:
        o, d = ops.program_operators(ops.read_program(ctx.out / f"{n}.pte"))
        called, delegates = called | set(o), delegates | set(d)
    lowered["deploy"] = {"operators": sorted(called), "delegates": sorted(delegates),
                         **ops.requirements(called, delegates),
                         "runners": {"runners": ["python -m pipeline generate"], "text_llm_runner": False,
                                     "text_llm_runner_why": "two programs whose KV cache is an input and an output: "
                                                            "our Python runner passes it between calls"}}
    (ctx.out / "lower.json").write_text(json.dumps(lowered, indent=2))
    sizes = {n: (ctx.out / f"{n}.pte").stat().st_size for n in COMPONENTS}
    return {"pte_bytes": sum(sizes.values()), "deploy": lowered["deploy"], **{f"{n}_pte_bytes": b for n, b in sizes.items()},
            "delegated_nodes": lowered["delegated_nodes"], "non_delegated_nodes": lowered["non_delegated_nodes"]}


def artifacts(entry) -> dict:
    """The run manifest's `pte` is the ExportedModel.from_pretrained folder; `programs` names the two files."""
    return {"pte": str(entry), "programs": {n: str(entry / f"{n}.pte") for n in COMPONENTS}}


# --- preflight: what this route can build and verify here ----------------------------------------------------

def handover_backends() -> list[str]:
    return [name for name, b in BACKENDS.items() if b.HANDOVER_CACHE is not None]


def problems(cfg) -> list[tuple[str, object, str]]:
    e, c, vc = cfg.export, cfg.cache, cfg.verify
    out = []
    route = "with export.exporter=transformers"
    backend = v(cfg.backend.name)
    if BACKENDS[backend].HANDOVER_CACHE is None:
        out.append(("backend.name", backend, f"{route} allowed: {handover_backends()} "
                                             f"({BACKENDS[backend].HANDOVER_CACHE_WHY})"))
    if adapter.separate(cfg):
        out.append(("model.adapter_mode", "separate", f"{route}: an adapter kept apart is the native route's program "
                    "(export.exporter=native), or merge it (model.adapter_mode=merge)"))
    if v(c.mode) != "static":
        out.append(("cache.mode", v(c.mode), f"{route} allowed: ['static'] (the exporter brings its own cache, passed "
                                             "in and out of the programs: xnnpack a StaticCache, mlx a DynamicCache; "
                                             "custom/offgraph are the native route's)"))
    if vc.native:
        out.append(("verify.native", vc.native, f"{route} allowed: [false]: the C++ runner runs the native one-program "
                                               "layout and cannot load prefill.pte + decode.pte with the KV cache as "
                                               "program input/output; verify runs them in the Python runtime"))
    if v(e.logits_mode) not in ("full", "auto"):  # auto is full here
        out.append(("export.logits_mode", v(e.logits_mode), f"{route} allowed: ['full'] (the exporter drops "
                                                            "logits_to_keep: prefill returns every row's logits)"))
    if e.strict:
        out.append(("export.strict", e.strict, f"{route} allowed: [false] (the exporter traces non-strict with its "
                                              "own patches; strict dynamo tracing fails on them)"))
    dtypes = BACKENDS[backend].HANDOVER_DTYPES if BACKENDS[backend].HANDOVER_CACHE else ()
    if BACKENDS[backend].HANDOVER_CACHE and v(e.dtype) not in dtypes:
        out.append(("export.dtype", v(e.dtype), f"{route} on {backend} allowed: {list(dtypes)} "
                                                f"({BACKENDS[backend].HANDOVER_DTYPES_WHY})"))
    if e.fault is not None:
        out.append(("export.fault", v(e.fault), f"{route} allowed: [null] (faults are injected on the native route)"))
    if e.prefill_chunk < 2:
        out.append(("export.prefill_chunk", e.prefill_chunk, f"{route} must be >= 2: the token count is traced "
                                                             "symbolic from a >= 2-token sample"))
    return out


def geometry_problems(cfg, g) -> list[tuple[str, object, str]]:
    if not g.smallest_window:
        return []
    return [("export.exporter", "transformers", f"allowed for models without sliding-window layers only ({g.arch} "
             f"has window {g.smallest_window}): pipeline/runtimes/pair.py runs one StaticCache mask per program, not "
             "the per-layer-type masks and ring layers of a sliding-window cache")]
