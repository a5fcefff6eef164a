"""Mixture-of-experts layers in a form that exports: each expert's weights as linears, and a token runs only the
experts its router picked.

HF keeps a layer's experts as stacked 3-D weights and runs them through `transformers::grouped_mm_fallback` or a
Python loop over the experts hit, neither of which lowers. The rewrite (at wrap, after HF's own forward has given the
reference logits) replaces the bank with `ExpertBank`: one `Expert` of nn.Linear per expert, so every quantization
scheme, override and backend applies to the experts as to any linear. The router is HF's module, untouched and in
float. Per expert, the rows routed to it are found with nonzero (a size known only at run time, at most the step's
rows), gathered, run through the expert and added back weighted: a decode step runs its top-k experts, not all.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model import archs


class Expert(nn.Module):
    """One expert: gate, up and down linears (names: archs.EXPERT_LINEARS) and the entry's gated activation."""

    def __init__(self, hidden: int, width: int, bias: bool, activation: str, act_fn=None, limit: float = 0.0,
                 alpha: float = 0.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=bias)
        self.up_proj = nn.Linear(hidden, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)
        self.activation, self.act_fn, self.limit, self.alpha = activation, act_fn, limit, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "clamped_swiglu":  # gpt-oss: clamped gate and up, gate * sigmoid(alpha * gate)
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        return self.down_proj(self.act_fn(gate) * up)


class ExpertBank(nn.Module):
    """A layer's experts; forward(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H], as HF's."""

    def __init__(self, experts: list[Expert], top_k: int):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.top_k = top_k

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        picks, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1)
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self.experts):
            # the (token, slot) entries that picked expert e: a token picks an expert at most once, so at most n
            hit = torch.nonzero(picks == e).reshape(-1)
            torch._check(hit.shape[0] <= n)
            rows = torch.div(hit, self.top_k, rounding_mode="floor")
            y = expert(hidden.index_select(0, rows)) * weights.index_select(0, hit).unsqueeze(-1).to(hidden.dtype)
            out = out.index_add(0, rows, y)
        return out


def _split(bank: nn.Module, x: archs.Experts, e: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Expert e's gate, up and down weights ([out, in]) and biases from HF's stacked layout."""
    if x.layout == "interleaved":  # gpt-oss: x @ W, gate and up in alternating columns, biases
        gu, gub = bank.gate_up_proj[e], bank.gate_up_proj_bias[e]
        return {"gate": (gu[:, ::2].t(), gub[::2]), "up": (gu[:, 1::2].t(), gub[1::2]),
                "down": (bank.down_proj[e].t(), bank.down_proj_bias[e])}
    gate, up = bank.gate_up_proj[e].chunk(2, dim=0)  # W @ x, gate rows then up rows
    return {"gate": (gate, None), "up": (up, None), "down": (bank.down_proj[e], None)}


def _expert(bank: nn.Module, x: archs.Experts, e: int) -> Expert:
    parts = _split(bank, x, e)
    width, hidden = parts["gate"][0].shape
    expert = Expert(hidden, width, bias=parts["gate"][1] is not None, activation=x.activation,
                    act_fn=getattr(bank, "act_fn", None), limit=float(getattr(bank, "limit", 0.0) or 0.0),
                    alpha=float(getattr(bank, "alpha", 0.0) or 0.0))
    for role, name in archs.EXPERT_LINEARS.items():
        w, b = parts[role]
        linear = getattr(expert, name)
        linear.weight = nn.Parameter(w.detach().clone().contiguous(), requires_grad=False)
        if b is not None:
            linear.bias = nn.Parameter(b.detach().clone(), requires_grad=False)
    return expert.to(parts["gate"][0].dtype)


@torch.no_grad()
def rewrite_experts(model: nn.Module) -> int:
    """Replace every MoE layer's HF expert bank by an ExpertBank (in place); returns how many layers were rewritten."""
    a = archs.of_model(model)
    if a.experts is None:
        return 0
    config = model.config.get_text_config()
    top_k = getattr(config, a.experts.top_k_key)
    count = 0
    for layer in a.decoder_layers(model):
        if not a.has_experts(layer):
            continue
        block = a.mlp_module(layer)
        bank = getattr(block, a.experts.bank)
        if isinstance(bank, ExpertBank):
            continue
        n = getattr(config, a.experts.count_key)
        setattr(block, a.experts.bank, ExpertBank([_expert(bank, a.experts, e) for e in range(n)], top_k))
        count += 1
    return count


def expert_banks(model: nn.Module) -> list[ExpertBank]:
    return [m for m in model.modules() if isinstance(m, ExpertBank)]

