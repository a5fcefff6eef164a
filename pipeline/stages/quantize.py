"""quantize: torchao schemes for linears and embeddings (embeddings first), with lm_head re-tie.

    python -m pipeline recipe=tiny_llama_xnnpack_8da4w
    python -m pipeline recipe=smollm2_xnnpack quantize=8da4w

Schemes: linear none|8w|4w|8da4w, embedding none|8w|4w; group size 0 = per output channel / per row.
Writes module.pt (the quantized eager module) and quantize.json (what was quantized, how).
"""
from __future__ import annotations

import json
import logging

import torch
from torch import nn

from pipeline.config import v
from pipeline.report.progress import spinner

NAME, VERSION = "quantize", 1
AFTER = ("wrap",)
CONFIG_KEYS = ("quantize",)

log = logging.getLogger(__name__)


def _granularity(group: int):
    from torchao.quantization.granularity import PerAxis, PerGroup
    return PerGroup(group) if group > 0 else PerAxis(0)


def linear_config(scheme: str, group: int):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    if scheme == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                     weight_granularity=_granularity(group))
    if scheme in ("4w", "8w"):
        return IntxWeightOnlyConfig(weight_dtype=torch.int4 if scheme == "4w" else torch.int8,
                                    granularity=_granularity(group))
    if scheme == "nvfp4":
        return nvfp4_config()
    raise ValueError(f"quantize.linear={scheme!r}: not available on this backend")


def embedding_config(scheme: str, group: int):
    from torchao.quantization import IntxWeightOnlyConfig
    if scheme in ("4w", "8w"):
        return IntxWeightOnlyConfig(weight_dtype=torch.int4 if scheme == "4w" else torch.int8,
                                    granularity=_granularity(group))
    if scheme == "nvfp4":
        return nvfp4_config()
    raise ValueError(f"quantize.embedding={scheme!r}: not available on this backend")


def nvfp4_config():
    # fp4 (e2m1) values in groups of 16 with fp8 scales, in the exportable form the MLX delegate matches
    from executorch.extension.llm.export.nvfp4 import ExportableNVFP4Config
    return ExportableNVFP4Config(use_per_tensor_scale=False)


def should_retie(model, q) -> bool:
    ties = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    same = v(q.linear) == v(q.embedding) and q.linear_group_size == q.embedding_group_size
    return ties and same and v(q.linear) != "none" and q.tie_word_embeddings


def quantize_module(module: nn.Module, q) -> dict:
    """Quantize a wrapped module in place; returns a report."""
    from torchao.quantization import quantize_

    model = module.model
    lin, emb = v(q.linear), v(q.embedding)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    retie = tied and should_retie(model, q)
    if tied and (lin != "none" or emb != "none"):
        # quantize the two separately (or re-tie below): they may need different schemes
        head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    report = {"linear": lin, "embedding": emb, "tied_in_model": tied, "retied": False,
              "linear_layers": 0, "embedding_layers": 0}
    if emb != "none":
        quantize_(model, embedding_config(emb, q.embedding_group_size),
                  filter_fn=lambda m, _: isinstance(m, nn.Embedding))
        report["embedding_layers"] = sum(isinstance(m, nn.Embedding) for m in model.modules())
    if lin != "none":
        skip_head = retie  # the head will share the quantized embedding weight
        quantize_(model, linear_config(lin, q.linear_group_size),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not (skip_head and m is head))
        report["linear_layers"] = sum(isinstance(m, nn.Linear) for m in model.modules()) - int(skip_head)
    if retie:
        head.weight = embed.weight
        report["retied"] = True
    for m in model.modules():
        # torchao sets a per-instance extra_repr (a partial), which pickle cannot save
        m.__dict__.pop("extra_repr", None)
    return report


def run(ctx) -> dict:
    module = torch.load(ctx.inputs["wrap"] / "module.pt", weights_only=False)
    with spinner("quantize", ctx.progress), torch.no_grad():
        report = quantize_module(module, ctx.cfg.quantize)
    torch.save(module, ctx.out / "module.pt")
    (ctx.out / "quantize.json").write_text(json.dumps(report, indent=2))
    return report
