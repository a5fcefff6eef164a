"""How the quantize stage applies the schemes to a wrapped module (torchao).

The schemes are pipeline/model/quant/schemes.py's table (linears: none | 8w | 4w | 8da4w | 8da8w | nvfp4; embeddings:
none | 8w | 4w | nvfp4); which one each weight takes is pipeline/model/quant/resolve.py's. Group size 0 = per output
channel (per row). Embeddings are quantized first; a tied lm_head is re-tied to the quantized embedding when both
take the same scheme and group.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model.geometry import from_config
from pipeline.model.quant import resolve
from pipeline.model.quant.schemes import SCHEMES
from pipeline.registry import v


def _granularity(group: int):
    from torchao.quantization.granularity import PerAxis, PerGroup
    return PerGroup(group) if group > 0 else PerAxis(0)


def _algorithm(name: str):
    from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
        IntxChooseQParamsAlgorithm)
    # gptq: torchao lays the weight out (min-max), then pipeline/model/quant/gptq.py replaces its values and scales
    return {"minmax": IntxChooseQParamsAlgorithm.AFFINE, "hqq": IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY,
            "gptq": IntxChooseQParamsAlgorithm.AFFINE}[name]


def torchao_config(scheme: str, group: int, algorithm: str = "minmax"):
    """The torchao config of a scheme (linears and embeddings alike)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    if scheme == "nvfp4":
        # fp4 (e2m1) values in groups of 16 with fp8 scales, in the exportable form the MLX delegate matches
        from executorch.extension.llm.export.nvfp4 import ExportableNVFP4Config
        return ExportableNVFP4Config(use_per_tensor_scale=False)
    bits = SCHEMES[scheme].bits
    dtype = torch.int4 if bits == 4 else torch.int8
    if SCHEMES[scheme].dynamic:
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=_granularity(group),
                                                     intx_choose_qparams_algorithm=_algorithm(algorithm))
    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=_granularity(group),
                                intx_choose_qparams_algorithm=_algorithm(algorithm))


def linear_roles(model: nn.Module) -> dict[str, str]:
    """Each linear's role (pipeline/model/archs ROLES) by its module name, as the architecture's entry lays the model
    out (the geometry's own list: the same names preflight checks)."""
    return from_config(model.config.get_text_config()).linear_roles()


def linear_plan(model: nn.Module, q, retie: bool, plan=None) -> dict[tuple[str, int], list[str]]:
    """(scheme, group) -> the names of the linears that take it (resolve.linear decides; a re-tied head takes none:
    it shares the embedding's quantized weight). `plan`: the allocator's (quantize.target_bpw)."""
    head = model.get_output_embeddings()
    roles = linear_roles(model)
    out: dict[tuple[str, int], list[str]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or (m is head and retie):
            continue
        choice = resolve.linear(q, name, roles.get(name), head=m is head, plan=plan)
        if choice.scheme != "none":
            out.setdefault(choice.pair, []).append(name)
    return out


def weight_error(quantized: torch.Tensor, original: torch.Tensor) -> float:
    """Relative RMS error of a quantized weight against the float weight it came from."""
    w = quantized.dequantize() if hasattr(quantized, "dequantize") else quantized
    return float((w.float() - original).norm() / original.norm().clamp_min(1e-30))


def carry_source_grid(model: nn.Module, source, name: str, original: torch.Tensor, asymmetric_ok: bool) -> bool:
    """Swap in the source file's own blocks where the chosen scheme holds them exactly (pipeline/model/
    source_grid.py; `original`: the float weight of module `name` before quantization); True if carried."""
    from pipeline.model.quant.source_grid import gguf_name
    cfg = model.config.get_text_config()
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
    role = linear_roles(model).get(name)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    module = model.get_submodule(name)
    w = module.weight
    if getattr(w, "target_dtype", None) not in (torch.int4, torch.int8):
        return False
    new = source.carried(gguf_name(name, tied, role), original, 8 if w.target_dtype == torch.int8 else 4,
                         w.block_size[1], asymmetric_ok, w.activation_quantization, heads.get(role))
    if new is None:
        return False
    module.weight = nn.Parameter(new, requires_grad=False)
    return True


# torchao quantizes a weight through several float temporaries of its size; a weight above this many elements is
# quantized in slices of rows (every group lies within a row, so the values are the same) and joined again
CHUNK_ELEMENTS = 1 << 24


def quantize_one(model: nn.Module, name: str, config) -> None:
    """Quantize module `name` of model in place, in slices of rows when it is large."""
    from torchao.quantization import IntxUnpackedToInt8Tensor, quantize_

    module = model.get_submodule(name)
    rows, cols = module.weight.shape
    step = max(1, CHUNK_ELEMENTS // cols)
    parts = []
    for r in range(0, rows, step) if rows > step else ():
        piece = _same_kind(module, module.weight.detach()[r:r + step])
        quantize_(piece, config, filter_fn=lambda m, fqn: fqn == "")
        w = piece.weight
        if type(w) is not IntxUnpackedToInt8Tensor or tuple(w.block_size)[0] != 1:
            parts = []  # a layout whose groups may span rows (the first slice shows it): quantized whole
            break
        parts.append(w)
    if not parts:
        quantize_(model, config, filter_fn=lambda m, fqn: fqn == name)
        return
    module.weight = nn.Parameter(stack_rows(parts), requires_grad=False)


def stack_rows(parts: list):
    """torchao int weights of one layout (groups within rows) stacked by output row into one."""
    from torchao.quantization import IntxUnpackedToInt8Tensor
    first = parts[0]
    return IntxUnpackedToInt8Tensor(
        *(None if getattr(first, n) is None else torch.cat([getattr(p, n) for p in parts])
          for n in ("qdata", "scale", "zero_point")),
        first.target_dtype, first.block_size, first.dtype, first.activation_quantization)


def _same_kind(module: nn.Module, weight: torch.Tensor) -> nn.Module:
    """A linear or embedding holding `weight` (a slice of module's rows), for torchao to quantize alone."""
    if isinstance(module, nn.Embedding):
        piece = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
    else:
        piece = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        piece.weight = nn.Parameter(weight, requires_grad=False)
    return piece


def quantize_module(module: nn.Module, q, source=None, asymmetric_ok: bool = False, hessians=None, plan=None) -> dict:
    """Quantize a wrapped module in place; returns a report. With `source` (the model's GGUF, SourceGrid) and
    quantize.source_grid, weights whose scheme holds the file's own grid exactly carry it instead. With `hessians`
    (linear name -> X^T X / n, the calibrate stage's), int linears are rounded by GPTQ (pipeline/model/quant/gptq.py).
    `plan`: the allocator's linears (quantize.target_bpw), name -> {"scheme", "group_size"}."""
    from pipeline.model.quant import gptq
    model = module.model
    emb, algorithm = v(q.embedding), v(q.algorithm)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    ties = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    retie = tied and ties and resolve.retied(q, True)
    if tied and resolve.in_use(q) and not retie:
        # quantize the two separately: they take different schemes
        head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    report = {"parameters": sum(p.numel() for p in model.parameters()),  # tied counted once (the file's bits/weight)
              "linear": v(q.linear), "embedding": emb, "lm_head": resolve.head(q).scheme, "algorithm": algorithm,
              "tied_in_model": tied, "retied": False, "linear_layers": 0, "embedding_layers": 0, "by_scheme": {}}
    by_pair = linear_plan(model, q, retie, plan)
    # one module at a time, its float weight kept only until its error is measured: never a second copy of the model
    steps = [(n, torchao_config(*resolve.embedding(q).pair, algorithm))
             for n, m in model.named_modules() if isinstance(m, nn.Embedding) and emb != "none"]
    report["embedding_layers"] = len(steps)
    for (scheme, group), names in by_pair.items():
        config = torchao_config(scheme, group, algorithm)
        steps += [(n, config) for n in names]
        report["by_scheme"][f"{scheme} g{group}"] = len(names)
        report["linear_layers"] += len(names)
    errors, carried, rounded = {}, [], 0
    prepared: dict[int, gptq.Prepared] = {}  # by Hessian: the linears that read one input share its inverse
    for name, config in steps:
        original = model.get_submodule(name).weight.detach().clone()
        quantize_one(model, name, config)
        if hessians and name in hessians:
            h = hessians[name]
            if id(h) not in prepared:
                prepared[id(h)] = gptq.prepare(h)
            rounded += gptq.apply(model.get_submodule(name), original, prepared[id(h)])
        if retie and model.get_submodule(name) is embed:
            head.weight = embed.weight  # the float weight goes now, not after the linears
        if q.source_grid and source and carry_source_grid(model, source, name, original, asymmetric_ok):
            carried.append(name)
        errors[name] = weight_error(model.get_submodule(name).weight, original)
        del original
    report["weights"] = {"quantized": len(steps), "carried": len(carried), "gptq": rounded,
                         "rel_rms_mean": _mean(errors.values()),
                         "rel_rms_max": max(errors.values(), default=0.0),
                         "requantized_rel_rms_mean": _mean(e for n, e in errors.items() if n not in carried)}
    if retie:
        head.weight = embed.weight
        report["retied"] = True
    for m in model.modules():
        # torchao sets a per-instance extra_repr (a partial), which pickle cannot save
        m.__dict__.pop("extra_repr", None)
    return report


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0
