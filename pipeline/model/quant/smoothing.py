"""Activation smoothing before quantization (`quantize.smoothing`, SmoothQuant's migration).

A linear's input has a few channels far larger than the rest. Two things then go wrong. XNNPACK's dynamic int8
quantization spends its per-row range on those channels. The weight columns that meet them carry the error of
4-bit groups into large products. Each input channel j is divided by s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)
and the matching weight column is multiplied by it. The division is folded into whatever produced the input, as the
architecture's entry (pipeline/model/archs) lays the layer out:
- the norm before the attention projections, and the norm before the MLP (one norm for both in a parallel block);
  a post-norm layer's projections read the residual stream, which nothing can absorb: they stay as they are;
- up's rows before down (each expert's own; not under gpt-oss's clamped SwiGLU, which is not linear in up);
- v's rows before o. There s is shared by the query heads that read one KV head; not with value norms (Gemma 4).
A mixture-of-experts router reads the MLP's input too: its columns take the scales as well, and it stays in float.
The float model computes the same function (up to rounding). Only what quantization loses changes.
SmolLM2-135M 8da4w + hqq, eager: corpus KLD 0.31 -> 0.19 at alpha 0.5 (docs/fidelity.md, `python bench/fidelity.py`).

The maxima come from the calibration set (pipeline/corpus.py: eight domains, none of them held out), which neither
the fidelity bench nor verify scores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pipeline.model import archs
from pipeline.model.geometry import layer_config

SCALES_FILE = "smoothing.pt"  # the quantize stage's record of `smooth`'s scales, per linear


@dataclass
class Rows:
    """Rows [start, stop) of a linear's output (the whole linear when stop is None)."""
    linear: nn.Linear
    start: int = 0
    stop: Optional[int] = None


@dataclass
class Group:
    """Linears (and router weights) that read one input; `hook` sees that input; the division folds into `norm`
    (scaled by offset + weight) or into `rows`; `heads` (hq, hkv, d): o's input, one scale per KV channel."""
    key: str
    hook: nn.Module
    readers: list
    norm: Optional[nn.Module] = None
    rows: Optional[Rows] = None
    heads: Optional[tuple[int, int, int]] = None


def _linear(parent: nn.Module, name: Optional[str]) -> Optional[nn.Linear]:
    m = getattr(parent, name, None) if name else None
    return m if isinstance(m, nn.Linear) else None


def _attention_inputs(a: archs.Arch, attn: nn.Module) -> list:
    at = a.attention
    return [m for m in (_linear(attn, at.qkv),) if m] or [m for m in (_linear(attn, n) for n in (at.q, at.k, at.v)) if m]


def _recurrent_inputs(a: archs.Arch, kind: str, layer: nn.Module) -> list:
    """A recurrent layer's input projections (they read the attention's norm). Its output projection reads a gated
    norm (Gated DeltaNet, Mamba-2) or a product C * conv (short conv): it is left alone."""
    mixer = layer.get_submodule(a.mixer_path(kind))
    names = (a.gated_delta.qkv, a.gated_delta.z, a.gated_delta.b, a.gated_delta.a) if kind == "linear_attention" \
        else (a.mamba2.in_proj,) if kind in ("mamba", "hybrid") else (a.short_conv.in_proj,)
    return [m for m in (_linear(mixer, n) for n in names) if m]


def _mlp_inputs(a: archs.Arch, layer: nn.Module) -> tuple[Optional[nn.Module], list]:
    """(the module whose input is the MLP's, the weights that read it)."""
    mlp = a.mlp_module(layer)
    if a.has_experts(layer):
        router = mlp.get_submodule(a.experts.router)
        bank = getattr(mlp, a.experts.bank)
        weight = (getattr(router, a.experts.router_linear) if a.experts.router_linear else router).weight
        ins = [n for r, n in archs.expert_linears(a.experts.activation).items() if r != "down"]
        readers = [weight] + [getattr(e, n).weight for e in bank for n in ins]
        shared = a.shared_expert(layer)
        if shared is not None:  # the shared expert and its gate read the same input
            names = (a.mlp.gate_up,) if a.mlp.gate_up else (a.mlp.gate, a.mlp.up) if a.mlp.gate else (a.mlp.up,)
            readers += [getattr(shared, n).weight for n in names]
            if a.experts.shared_gate:
                readers.append(getattr(mlp, a.experts.shared_gate).weight)
        return router, readers
    linears = [m for m in (_linear(mlp, a.mlp.gate_up),) if m] or \
        [m for m in (_linear(mlp, a.mlp.gate), _linear(mlp, a.mlp.up)) if m]
    return (linears[0] if linears else None), [m.weight for m in linears]


def _down_groups(a: archs.Arch, i: int, layer: nn.Module) -> list[Group]:
    """down's input = act(gate) * up: its scales fold into up's rows (per expert). Without a gate, down reads
    act(up): no scale passes an activation, so down is left alone."""
    mlp = a.mlp_module(layer)
    if a.has_experts(layer):
        if a.experts.activation != "silu":
            return []
        bank = getattr(mlp, a.experts.bank)
        groups = [Group(f"{i}.down.{e}", x.down_proj, [x.down_proj.weight], rows=Rows(x.up_proj))
                  for e, x in enumerate(bank)]
        shared = a.shared_expert(layer)
        if shared is not None:
            down, fused = getattr(shared, a.mlp.down), _linear(shared, a.mlp.gate_up)
            up = Rows(fused, fused.out_features // 2, fused.out_features) if fused else Rows(getattr(shared, a.mlp.up))
            groups.append(Group(f"{i}.down.shared", down, [down.weight], rows=up))
        return groups
    down = _linear(mlp, a.mlp.down)
    if not a.mlp.gate and not a.mlp.gate_up:
        return []
    fused = _linear(mlp, a.mlp.gate_up)
    up = Rows(fused, fused.out_features // 2, fused.out_features) if fused else Rows(_linear(mlp, a.mlp.up))
    return [Group(f"{i}.down", down, [down.weight], rows=up)] if down is not None and up.linear is not None else []


def _o_group(a: archs.Arch, i: int, attn: nn.Module, config) -> list[Group]:
    """o's input is v's output: its scales fold into v's rows (the v rows of a fused qkv)."""
    at, lc = a.attention, layer_config(config, i)
    hq, hkv, d = config.num_attention_heads, lc.num_key_value_heads, a.head_dim(lc)
    o = _linear(attn, at.o)
    if at.v_norm or o is None:
        return []
    fused, v = _linear(attn, at.qkv), _linear(attn, at.v)
    rows = Rows(fused, hq * d + hkv * d, hq * d + 2 * hkv * d) if fused else (Rows(v) if v is not None else None)
    return [Group(f"{i}.o", o, [o.weight], rows=rows, heads=(hq, hkv, d))] if rows is not None else []


def groups(model: nn.Module) -> list[Group]:
    """The smoothing groups of an HF causal LM (experts rewritten), as its architecture's entry lays it out."""
    a = archs.of_model(model)
    config = model.config.get_text_config()
    out: list[Group] = []
    kinds = a.layer_kinds(config)
    for i, layer in enumerate(a.decoder_layers(model)):
        kind = kinds[i]
        mixer = kind not in archs.MLP_KINDS   # a block model's MLP layer has none
        recurrent = kind in archs.RECURRENT_KINDS
        attn = None if recurrent or not mixer else a.attention_module(layer)
        attn_in = [] if not mixer else _recurrent_inputs(a, kind, layer) if recurrent else _attention_inputs(a, attn)
        if kind in archs.PARALLEL_KINDS:  # the Mamba-2 mixer reads the attention's norm too
            attn_in = attn_in + _recurrent_inputs(a, kind, layer)
        mlp_hook, mlp_in = _mlp_inputs(a, layer) if a.has_mlp(kind) else (None, [])
        n = a.norms
        if n.attention_input and attn_in:
            shared = n.mlp_input == n.attention_input
            out.append(Group(f"{i}.attention", attn_in[0], [m.weight for m in attn_in] + (mlp_in if shared else []),
                             norm=getattr(layer, n.attention_input)))
        if n.mlp_input and (n.mlp_input != n.attention_input or not attn_in) and mlp_in:
            out.append(Group(f"{i}.mlp", mlp_hook, mlp_in, norm=getattr(layer, n.mlp_input)))
        out += (_down_groups(a, i, layer) if a.has_mlp(kind) else []) + \
            ([] if recurrent or not mixer else _o_group(a, i, attn, config))
    return out


class MaximaRecorder:
    """Per input channel max |x| of every smoothing group's input, kept by forward pre-hooks while installed; a group
    whose input never ran (an expert no token reached) has none."""

    def __init__(self, model: nn.Module):
        self.stats: dict[str, torch.Tensor] = {}
        self.hooks = [g.hook.register_forward_pre_hook(self._hook(g.key)) for g in groups(model)]

    def _hook(self, key: str):
        def hook(_, args):
            a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).float()
            if a.shape[0]:
                a = a.amax(0)
                self.stats[key] = torch.maximum(self.stats[key], a) if key in self.stats else a
        return hook

    def close(self) -> dict[str, torch.Tensor]:
        for h in self.hooks:
            h.remove()
        return self.stats


@torch.no_grad()
def activation_maxima(model: nn.Module, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """The maxima over uncached forwards of a float HF model (experts rewritten)."""
    recorder = MaximaRecorder(model)
    try:
        for ids in sequences:
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        stats = recorder.close()
    return stats


def _ratio(x: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = max|x|^alpha / max|w|^(1 - alpha), per channel, from the two maxima."""
    return (x.clamp_min(1e-5).pow(alpha) / w.clamp_min(1e-5).pow(1 - alpha)).clamp_min(1e-5)


def _column_max(weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([w.abs().float() for w in weights], 0).amax(0)


def _fold_into_norm(norm: nn.Module, s: torch.Tensor, offset: float) -> None:
    norm.weight.copy_(((offset + norm.weight.float()) / s - offset).to(norm.weight.dtype))
    if getattr(norm, "bias", None) is not None:
        norm.bias.div_(s.to(norm.bias.dtype))


def _scale_rows(rows: Rows, s: torch.Tensor) -> None:
    lin, stop = rows.linear, rows.stop or rows.linear.out_features
    lin.weight[rows.start:stop].div_(s[:, None].to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias[rows.start:stop].div_(s.to(lin.bias.dtype))


def _apply(g: Group, x: torch.Tensor, alpha: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooths one group; returns what its readers' input channels are divided by, and what the rows of `g.rows`
    (if any) were divided by."""
    if g.heads is not None:  # o: channel h*d + c reads KV head h // (hq // hkv): one scale per KV channel
        hq, hkv, d = g.heads
        w = _column_max(g.readers).view(hkv, hq // hkv, d).amax(1)
        s = _ratio(x.view(hkv, hq // hkv, d).amax(1), w, alpha).reshape(-1)
        _scale_rows(g.rows, s)
        cols = s.view(hkv, 1, d).expand(hkv, hq // hkv, d).reshape(-1)
    else:
        cols = s = _ratio(x, _column_max(g.readers), alpha)
        if g.norm is not None:
            _fold_into_norm(g.norm, s, offset)
        else:
            _scale_rows(g.rows, s)
    for w in g.readers:
        w.mul_(cols.to(w.dtype))
    return cols, s


@torch.no_grad()
def smooth(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float,
           input_scales: dict[str, torch.Tensor] | None = None, row_scales: dict | None = None) -> int:
    """Fold the smoothing scales into a float HF model (experts rewritten) in place; returns the number of linears
    (and routers) whose inputs were smoothed. `input_scales` (if given) gets, per linear name, what its input is now
    divided by; `row_scales`, per linear whose output rows the division folded into, (start, stop, divisors): what a
    LoRA branch kept beside a linear must follow (pipeline/model/adapter.py)."""
    offset = archs.of_model(model).norms.offset
    linear_of = {id(m.weight): name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    smoothed = 0
    for g in groups(model):
        if g.key in maxima:
            cols, s = _apply(g, maxima[g.key], alpha, offset)
            smoothed += len(g.readers)
            if input_scales is not None:
                input_scales.update({linear_of[id(w)]: cols for w in g.readers if id(w) in linear_of})
            if row_scales is not None and g.rows is not None and id(g.rows.linear.weight) in linear_of:
                stop = g.rows.stop or g.rows.linear.out_features
                row_scales[linear_of[id(g.rows.linear.weight)]] = (g.rows.start, stop, s)
    return smoothed
