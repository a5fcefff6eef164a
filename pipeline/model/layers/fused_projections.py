"""Sibling projections that read the same input, fused into one wider linear before export (`export.
fuse_projections`): an attention layer's q/k/v, a gated MLP's gate/up, as the architecture's entry names them
(pipeline/model/archs).

Why: at decode every linear is its own XNNPACK operator, with its own dynamic quantization of the activation row
and its own thread-pool dispatch; SmolLM2 runs 7 of them per layer where 4 do the same work. The bits do not change:
an output of a linear depends only on the input row (quantized per row, the same for the siblings) and its own
weight row (quantized in groups along the row), and XNNPACK computes each output column alike wherever it sits.

How: the fused linear runs in a forward pre-hook of the parent, which hands the parent the fused output in place of
its input; each member becomes a `ProjectionSlice` of those columns. The parent's own forward (HF's) is unchanged.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from pipeline.model import archs

QKV, GATE_UP = "qkv_proj", "gate_up_proj"  # the fused linears' names (an entry that fuses already uses them)


class ProjectionSlice(nn.Module):
    """A fused member: its columns [start, stop) of the fused output the parent now receives."""

    def __init__(self, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop

    def forward(self, fused: torch.Tensor) -> torch.Tensor:
        return fused[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"columns [{self.start}, {self.stop})"


def _feed_fused(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the parent's input, replaced by the fused projection of it."""
    fused = getattr(module, module.fused_projection)
    if args:
        return (fused(args[0]), *args[1:]), kwargs
    name = module.fused_input
    return args, {**kwargs, name: fused(kwargs[name])}


def _layout(w) -> tuple:
    """What two quantized weights must share to be stacked: the same grid, group shape and activation handling."""
    return w.target_dtype, tuple(w.block_size), w.dtype, w.activation_quantization, w.zero_point is None


def _joined_weight(weights: list[torch.Tensor]):
    """The members' weights stacked by output row, or None where they cannot be (different quantization)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    from pipeline.model.quant.apply import stack_rows
    kinds = {type(w) for w in weights}
    if kinds == {nn.Parameter} or kinds == {torch.Tensor}:
        return torch.cat([w.detach() for w in weights])
    if kinds != {IntxUnpackedToInt8Tensor}:
        return None
    first = weights[0]
    if len({_layout(w) for w in weights}) != 1 or tuple(first.block_size)[0] != 1:
        return None
    return stack_rows(weights)


def _fuse(parent: nn.Module, fused_name: str, members: tuple[str, ...]) -> bool:
    linears = [getattr(parent, n, None) for n in members]
    if not all(type(m) is nn.Linear for m in linears):
        return False
    if len({m.in_features for m in linears}) != 1 or len({m.bias is None for m in linears}) != 1:
        return False
    weight = _joined_weight([m.weight for m in linears])
    if weight is None:
        return False
    fused = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                      bias=linears[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    setattr(parent, fused_name, fused)
    start = 0
    for name, m in zip(members, linears):
        setattr(parent, name, ProjectionSlice(start, start + m.out_features))
        start += m.out_features
    parent.fused_projection = fused_name
    parent.fused_input = next(iter(inspect.signature(parent.forward).parameters))
    parent.register_forward_pre_hook(_feed_fused, with_kwargs=True)
    return True


def _plans(model: nn.Module):
    """(parent, fused name, member names) of every split q/k/v and gate/up its architecture's entry declares: the
    attention modules and dense MLPs of HF's layers (each reads its input through these members alone). Experts
    are not fused: their kernel reads gate and up itself (pipeline/model/layers/experts.py)."""
    a = archs.of_model(model)
    at, m = a.attention, a.mlp
    attending = {id(layer) for _, layer in a.attention_layers(model)}
    kinds = a.layer_kinds(model.config.get_text_config())
    for layer, kind in zip(a.decoder_layers(model), kinds):
        if not at.qkv and id(layer) in attending:
            yield a.attention_module(layer), QKV, (at.q, at.k, at.v)
        if m.gate and not m.gate_up and a.has_mlp(kind) and not a.has_experts(layer):
            yield a.mlp_module(layer), GATE_UP, (m.gate, m.up)


def fuse_projections(model: nn.Module) -> dict:
    """Fuse every split q/k/v and gate/up in place (where the members' weights share one quantization); returns
    {fused name: count, "kept": parents left as they were}."""
    report = {QKV: 0, GATE_UP: 0, "kept": 0}
    for parent, name, members in list(_plans(model)):
        if _fuse(parent, name, members):
            report[name] += 1
        else:
            report["kept"] += 1
    return report
