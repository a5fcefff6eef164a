"""The transformers.exporters route (export.exporter=transformers): the export and lower stages' work.

    python -m pipeline recipe=tiny_llama_hf_exporter
    python -m pipeline recipe=smollm2_xnnpack_hf_exporter

transformers 5.22+ ships `transformers.exporters.ExecutorchExporter`. It captures a model's prefill and decode
forwards from a real `generate()` and exports each as its own ExecuTorch program (torch.export with its own
patches, non-strict, then lowered inside the same call), the KV cache (a `StaticCache`) passed in and returned as
program inputs and outputs. Around it, everything is ours: the same download/wrap/quantize entries as the native
route (the wrapped eager modules stay verify's references), the stage cache, the manifests, verify.

- export: the quantize stage's eager model is handed over (quantization is ours, torchao, not the exporter's
  quantizer), after two module rewrites the exporter cannot be told about: weight-only linears in the forms XNNPACK
  runs correctly (pipeline/backends/xnnpack_woq.py: the exporter's stock partitioner drops their scales), and
  quantized embeddings as `quantized_decomposed::embedding_{byte,4bit}` (the exporter's ExecutorchBackendConfig does
  no quant fusion, so torchao's `dequantize_affine` would be left without an out variant). Writes prefill.pte,
  decode.pte, export.json (the exporter's own manifest: the pytree specs of each program's inputs and outputs),
  config.json, generation_config.json, and hf_export.json (ours: shapes, quantization handed over, delegation).
- lower: the exporter already lowered; links the pair into its entry (so that entry is a complete
  `ExportedModel.from_pretrained` folder) beside lower.json, which records what the native route bakes into its
  program as constant methods (EOS ids, context, chunk, ...): these programs carry none.

backend=mlx: the exporter's mlx backend refuses a StaticCache, so the capture runs generate() over a DynamicCache
(prefill.pte takes no cache and returns each layer's K/V; decode.pte takes the K/V so far, a dynamic length
1..context-1, and returns them grown by the new tokens), nothing is rewritten before the handover (the MLX
partitioner lowers torchao's tensors itself), and the whole graph lands in the MLX delegate.

Verify runs the pair through pipeline/hf_runtime.py (backend=mlx: DynamicCacheModule, each program's MLX payload
executed by pipeline/mlx_interpreter.py). The C++ runner does not know this layout (preflight refuses
verify.native=true, see pipeline/validate.py).
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

from pipeline.config import v
from pipeline.progress import spinner

log = logging.getLogger(__name__)

COMPONENTS = ("prefill", "decode")
# files of an exporter folder that the lower entry carries (ExportedModel.from_pretrained reads them)
FOLDER_FILES = ("prefill.pte", "decode.pte", "export.json", "config.json", "generation_config.json")
# the token axis of each per-token input the exporter captures (attention_mask: the decode's 4D [1, 1, T, context])
TOKEN_AXIS = {"input_ids": 1, "position_ids": 1, "attention_mask": 2}


# --- handover: the quantize stage's model in forms the exporter's stock lowering gets right --------------------

class QuantizedEmbedding(nn.Module):
    """A torchao weight-only embedding as `quantized_decomposed::embedding_byte` / `embedding_4bit`.

    Same numbers as torchao's dequantize ((q - zero_point) * scale, small integers times a float), but an op with
    an out variant in ExecuTorch's quantized kernels, so no quant-fusion pass is needed at to_executorch.
    """

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, zero_point, bits: int):
        super().__init__()
        self.bits = bits
        self.qmin, self.qmax = (-8, 7) if bits == 4 else (-128, 127)
        if bits == 4:  # two values a byte, offset to [0, 15], even column in the high nibble (the kernel's layout)
            u = (qdata.to(torch.int16) + 8).to(torch.uint8)
            qdata = (u[:, 0::2] << 4) | u[:, 1::2]
        self.register_buffer("qweight", qdata.contiguous())
        self.register_buffer("scales", scale.to(torch.float32).contiguous())
        zp = None if zero_point is None or not bool((zero_point != 0).any()) else \
            zero_point.to(torch.float32).reshape(self.scales.shape).contiguous()
        self.register_buffer("zero_points", zp)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        op = torch.ops.quantized_decomposed.embedding_4bit if self.bits == 4 else \
            torch.ops.quantized_decomposed.embedding_byte
        return op.default(self.qweight, self.scales, self.zero_points, self.qmin, self.qmax, indices)


def quantized_embeddings(model: nn.Module, bits: int) -> int:
    """Swap torchao weight-only embeddings for QuantizedEmbedding; returns how many."""
    import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  (defines the embedding ops)
    n = 0
    for _, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            if not (isinstance(child, nn.Embedding) and hasattr(w, "qdata")):
                continue
            if list(w.block_size)[0] != 1:
                raise ValueError(f"embedding {name}: unsupported block size {w.block_size}")
            scale = w.scale[:, 0] if w.scale.dim() == 2 and w.scale.shape[1] == 1 else w.scale
            zp = None if w.zero_point is None else w.zero_point.reshape(w.scale.shape)
            if zp is not None and zp.dim() == 2 and zp.shape[1] == 1:
                zp = zp[:, 0]
            setattr(parent, name, QuantizedEmbedding(w.qdata, scale, zp, bits))
            n += 1
    return n


def handover_model(quantized_module_path: Path, q, backend: str) -> tuple[nn.Module, dict]:
    """The quantize stage's HF model, rewritten for the exporter; returns it and what was done (for the manifest)."""
    module = torch.load(quantized_module_path, weights_only=False)
    model = module.model  # the wrapper's static cache buffers stay behind: the exporter brings its own cache
    del module
    lin, emb = v(q.linear), v(q.embedding)
    done = {"applied_by": "pipeline quantize stage (torchao), before the handover", "exporter_quantizer": None,
            "linear": lin, "embedding": emb, "linear_forms": {}, "quantized_embeddings": 0}
    if backend == "mlx":  # no rewrite: the MLX partitioner lowers torchao's tensors as they are (XNNPACK's forms below)
        n = sum(hasattr(m.weight, "qdata") for m in model.modules() if isinstance(m, nn.Linear))
        done["linear_forms"] = {"torchao tensors (MLX QuantizedMatmulNode)": n} if n else {}
        if emb != "none":
            done["embedding_form"] = "torchao tensor (MLX DequantizeNode + TakeNode)"
    elif lin in ("4w", "8w"):  # the stock partitioner would drop their scales (pipeline/backends/xnnpack_woq.py)
        from pipeline.backends.xnnpack_woq import prepare_weight_only_linears
        forms = prepare_weight_only_linears(model, 4 if lin == "4w" else 8)
        # the exporter's stock partitioner delegates neither form: both run on portable kernels (correct, slower;
        # the delegation report in hf_export.json / lower.json shows it)
        done["linear_forms"] = {"quantized_decomposed::dequantize_per_channel + linear": forms["xnnpack_per_channel"],
                                "quantized_decomposed::mixed_linear": forms["mixed_linear"]}
    elif lin == "8da4w":
        done["linear_forms"] = {"torchao 8da4w (XNNPACK dynamically quantized linear)":
                                sum(hasattr(m.weight, "qdata") for m in model.modules() if isinstance(m, nn.Linear))}
    if emb in ("4w", "8w") and backend != "mlx":
        done["quantized_embeddings"] = quantized_embeddings(model, 4 if emb == "4w" else 8)
        done["embedding_form"] = "quantized_decomposed::embedding_4bit" if emb == "4w" else \
            "quantized_decomposed::embedding_byte"
    for m in model.modules():
        m.__dict__.pop("extra_repr", None)  # torchao's per-instance partial
    model.eval()
    return model, done


# --- export ---------------------------------------------------------------------------------------------------

# the cache each backend's programs take: the exporter's mlx backend refuses a StaticCache
CACHE = {"xnnpack": "StaticCache", "mlx": "DynamicCache"}


def generation_config(model, context: int, backend: str = "xnnpack"):
    """Greedy generate() over a static cache of the full context (the decode program then takes a fixed-size cache),
    or for mlx over a dynamic cache (the decode program takes the cache so far, of any length)."""
    from transformers import GenerationConfig
    cfg = model.config.get_text_config()
    eos = cfg.eos_token_id
    cache = {"cache_implementation": "static", "max_cache_len": context} if CACHE.get(backend, "StaticCache") == "StaticCache" else \
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


def export_stage(ctx) -> dict:
    import torchao  # noqa: F401  (registers the quantized ops a torchao model traces to)
    from transformers.exporters import ExecutorchConfig, ExecutorchExporter, ExportedModel
    from transformers.exporters.utils import decompose_for_generation

    from pipeline.runtime import load_kernels
    load_kernels()  # out variants of the quantized_decomposed ops left outside the delegate

    e, backend = ctx.cfg.export, v(ctx.cfg.backend.name)
    if backend == "mlx":
        from pipeline.backends.mlx import _import_mlx
        _import_mlx()  # the wheel lacks the delegate's generated schema modules until this runs once
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
        config = ExecutorchConfig(backend=backend, dynamic_shapes=shapes, strict=e.strict,
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
            **({"dynamic_past": [1, e.max_context_len - 1]} if name == "decode" and CACHE.get(backend) == "DynamicCache"
               else {}),
            **delegation(components[name].program),
        }
    exported = ExportedModel(components, exporter.export_format, config=model.config, generation_config=gen)
    exported.save_pretrained(ctx.out)
    del exported, components, model
    gc.collect()
    report["quantization"] = quant
    report["exporter"] = {"class": "transformers.exporters.ExecutorchExporter", "strict": bool(e.strict),
                          "multi_token_decode": True, "cache": CACHE.get(backend, "StaticCache"), "max_cache_len": e.max_context_len}
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


def lower_stage(ctx) -> dict:
    from pipeline.stages.lower import constant_methods
    src = ctx.inputs["export"]
    for name in FOLDER_FILES:
        if (src / name).exists():
            _link(src / name, ctx.out / name)
    report = json.loads((src / "hf_export.json").read_text())
    comps = report["components"]
    lowered = {
        "layout": "prefill+decode (transformers.exporters), KV cache as program input/output",
        "cache": report.get("exporter", {}).get("cache", "StaticCache"),
        "programs": {n: {"file": f"{n}.pte", **{k: comps[n][k] for k in
                         ("delegated_subgraphs", "delegated_nodes", "non_delegated_nodes", "by_op")}}
                     for n in COMPONENTS},
        # these programs carry no constant methods: the values the native route bakes in, for verify and readers
        "constant_methods": constant_methods(ctx),
        "delegated_nodes": sum(comps[n]["delegated_nodes"] for n in COMPONENTS),
        "non_delegated_nodes": sum(comps[n]["non_delegated_nodes"] for n in COMPONENTS),
    }
    (ctx.out / "lower.json").write_text(json.dumps(lowered, indent=2))
    sizes = {n: (ctx.out / f"{n}.pte").stat().st_size for n in COMPONENTS}
    return {"pte_bytes": sum(sizes.values()), **{f"{n}_pte_bytes": b for n, b in sizes.items()},
            "delegated_nodes": lowered["delegated_nodes"], "non_delegated_nodes": lowered["non_delegated_nodes"]}
