"""Mixture-of-experts layers in a form that exports: each expert's weights as linears, and a token runs only the
experts its router picked.

HF keeps a layer's experts as stacked 3-D weights and runs them through `transformers::grouped_mm_fallback` or a
Python loop over the experts hit, neither of which lowers. The rewrite (at wrap, after HF's own forward has given the
reference logits) replaces the bank with `ExpertBank`: one `Expert` of nn.Linear per expert, so every quantization
scheme and override applies to the experts as to any linear. The router is HF's module, untouched and in float.

At export each bank becomes one `llmpipe::experts` op (PackedExperts) over the experts' stacked weights, as
quantized: its kernel (native/) runs, per expert, only the rows routed to it, so a decode step reads its top-k
experts' weights, not all. In the graph instead, the rows per expert have a size known only at run time, and
torchao's dynamic activation quantization cannot trace such a size (it compares it with 1 and 0 while tracing).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.model import archs


class Expert(nn.Module):
    """One expert: gate, up and down linears (names: archs.EXPERT_LINEARS; an ungated activation's expert has no
    gate) and the entry's activation."""

    def __init__(self, hidden: int, width: int, bias: bool, activation: str, act_fn=None, limit: float = 0.0,
                 alpha: float = 0.0):
        super().__init__()
        if activation not in archs.UNGATED_ACTIVATIONS:
            self.gate_proj = nn.Linear(hidden, width, bias=bias)
        self.up_proj = nn.Linear(hidden, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)
        self.activation, self.act_fn, self.limit, self.alpha = activation, act_fn, limit, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "relu2":  # Nemotron-H: relu(up)^2, no gate
            return self.down_proj(torch.square(F.relu(self.up_proj(x))))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "clamped_swiglu":  # gpt-oss: clamped gate and up, gate * sigmoid(alpha * gate)
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        return self.down_proj(self.act_fn(gate) * up)


class ExpertBank(nn.ModuleList):
    """A layer's experts, a list (expert e's linears are named `<bank>.<e>.gate_proj`, as the geometry lists them);
    forward(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H], as HF's bank. Eager only: export
    packs it for the llmpipe::experts op (PackedExperts, below)."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            rows, slots = torch.nonzero(top_k_index == e, as_tuple=True)
            if rows.numel():  # an expert no row picked runs nothing
                y = expert(hidden[rows]) * top_k_weights[rows, slots].unsqueeze(-1).to(hidden.dtype)
                out.index_add_(0, rows, y)
        return out


def _split(bank: nn.Module, x: archs.Experts, e: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Expert e's gate, up and down weights ([out, in]) and biases from HF's stacked layout."""
    if x.layout == "interleaved":  # gpt-oss: x @ W, gate and up in alternating columns, biases
        gu, gub = bank.gate_up_proj[e], bank.gate_up_proj_bias[e]
        return {"gate": (gu[:, ::2].t(), gub[::2]), "up": (gu[:, 1::2].t(), gub[1::2]),
                "down": (bank.down_proj[e].t(), bank.down_proj_bias[e])}
    if x.layout == "ungated":  # W @ x, up alone
        return {"up": (bank.up_proj[e], None), "down": (bank.down_proj[e], None)}
    gate, up = bank.gate_up_proj[e].chunk(2, dim=0)  # W @ x, gate rows then up rows
    return {"gate": (gate, None), "up": (up, None), "down": (bank.down_proj[e], None)}


def _expert(bank: nn.Module, x: archs.Experts, e: int) -> Expert:
    parts = _split(bank, x, e)
    width, hidden = parts["up"][0].shape
    expert = Expert(hidden, width, bias=parts["up"][1] is not None, activation=x.activation,
                    act_fn=getattr(bank, "act_fn", None), limit=float(getattr(bank, "limit", 0.0) or 0.0),
                    alpha=float(getattr(bank, "alpha", 0.0) or 0.0))
    for role, name in archs.expert_linears(x.activation).items():
        w, b = parts[role]
        linear = getattr(expert, name)
        linear.weight = nn.Parameter(w.detach().clone().contiguous(), requires_grad=False)
        if b is not None:
            linear.bias = nn.Parameter(b.detach().clone(), requires_grad=False)
    return expert.to(parts["up"][0].dtype)


@torch.no_grad()
def rewrite_experts(model: nn.Module) -> int:
    """Replace every MoE layer's HF expert bank by an ExpertBank (in place); returns how many layers were rewritten."""
    a = archs.of_model(model)
    if a.experts is None:
        return 0
    config = model.config.get_text_config()
    count = 0
    for layer in a.decoder_layers(model):
        if not a.has_experts(layer):
            continue
        block = a.mlp_module(layer)
        bank = getattr(block, a.experts.bank)
        if isinstance(bank, ExpertBank):
            continue
        n = getattr(config, a.experts.count_key)
        setattr(block, a.experts.bank, ExpertBank([_expert(bank, a.experts, e) for e in range(n)]))
        count += 1
    return count


# --- the exported form: one op per MoE layer -------------------------------------------------------------------
# llmpipe::experts(hidden [N,H], top_k_index [N,k], top_k_weights [N,k], then per projection (gate, up, down): its
# weights [E, out, in] (fp32, or int8 values; 4-bit values two a byte, uint8 [E, out, in / 2]; both with fp32 group
# scales [E, out, in / group]) and biases [E, out];
# act_quant: per projection, whether its input rows are quantized to int8 first (the 8da schemes); activation:
# 0 silu, 1 gpt-oss's clamped SwiGLU, 2 relu(up)^2 with no gate: the gate's arguments repeat up's, unread)
# -> [N, H]. The C++ kernel (native/src/kernels/experts_kernel.cpp) runs, per expert, only the rows routed to it; an
# expert no row picked reads none of its weights.
NAMESPACE, OP_NAME = "llmpipe", "experts"
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1, "relu2": 2}
PROJECTIONS = ("gate", "up", "down")


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's dynamic int8 activation quantization (asymmetric, per row), as its 8da linears choose it: (q - zero
    point, each row's scale)."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine
    block = (1, x.shape[-1])
    scale, zp = choose_qparams_affine(x, MappingType.ASYMMETRIC, block, torch.int8, quant_min=-128, quant_max=127,
                                      zero_point_dtype=torch.int8)
    q = quantize_affine(x, block, scale, zp, torch.int8, quant_min=-128, quant_max=127)
    return q.double() - zp.double().reshape(-1, 1), scale.double()


def pack4(q: torch.Tensor) -> torch.Tensor:
    """4-bit values (int8 in [-8, 7], an even last dim) two a byte: w + 8, element 2i low nibble, 2i + 1 high."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack4(p: torch.Tensor) -> torch.Tensor:
    lo, hi = (p & 0x0F).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], -1).reshape(*p.shape[:-1], -1)


def _project(x: torch.Tensor, w: torch.Tensor, s, b, act_quant: bool) -> torch.Tensor:
    """fp32(x W^T + b) as the kernel computes it: with dynamic activations each group's dot exact (integers in
    float64), scaled by the group's and the row's scales; otherwise float64 sums; rounded to fp32 once."""
    row_scale = None
    if w.dtype == torch.uint8:
        w = unpack4(w)
    if act_quant:
        xd, row_scale = _quantize_rows(x)
    else:
        xd = x.double()
    wd = w.double()
    if s is None:
        y = xd @ wd.T
    else:
        groups = s.shape[-1]
        dots = torch.einsum("ngk,ogk->nog", xd.reshape(len(x), groups, -1), wd.reshape(len(w), groups, -1))
        y = (dots * s.double()).sum(-1)
    if row_scale is not None:
        y = y * row_scale.reshape(-1, 1)
    return (y if b is None else y + b.double()).float()


def _activate(g: torch.Tensor, u: torch.Tensor, activation: int, limit: float, alpha: float) -> torch.Tensor:
    """The activation in float64, rounded once (the kernel's)."""
    if activation == ACTIVATIONS["relu2"]:
        return torch.square(u.double().clamp(min=0)).float()
    if activation == ACTIVATIONS["clamped_swiglu"]:
        g, u = g.clamp(max=limit).double(), u.clamp(min=-limit, max=limit).double()
        alpha = float(torch.tensor(alpha, dtype=torch.float32))
        return ((u + 1) * (g / (1 + torch.exp(-g * alpha)))).float()
    g = g.double()
    return (g / (1 + torch.exp(-g)) * u.double()).float()


def experts_ref(hidden, top_k_index, top_k_weights, gate_w, gate_s, gate_b, up_w, up_s, up_b, down_w, down_s, down_b,
                act_quant, activation: int, limit: float, alpha: float) -> torch.Tensor:
    """The op's semantics in torch (eager; the C++ kernel's twin, rounding where it rounds: the activations'
    quantization in fp32 as torchao's, integer group dots, each projection and the activation in float64, the weighted
    sum in fp32)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    x_all = hidden.float()
    for e in range(gate_w.shape[0]):
        rows, slots = torch.nonzero(top_k_index == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        x = x_all[rows]
        pick = (lambda t: None if t is None else t[e])  # noqa: E731
        u = _project(x, up_w[e], pick(up_s), pick(up_b), bool(act_quant[1]))
        g = u if activation == ACTIVATIONS["relu2"] else \
            _project(x, gate_w[e], pick(gate_s), pick(gate_b), bool(act_quant[0]))
        a = _activate(g, u, activation, float(limit), float(alpha))
        y = _project(a, down_w[e], pick(down_s), pick(down_b), bool(act_quant[2]))
        out.index_add_(0, rows, y * top_k_weights[rows, slots].float().unsqueeze(-1))
    return out.to(hidden.dtype)


def _define() -> None:
    from pipeline.model.layers.attention import define_op

    def fake(hidden, *args):
        return torch.empty_like(hidden)

    projections = ", ".join(f"Tensor {p}_w, Tensor? {p}_s, Tensor? {p}_b" for p in PROJECTIONS)
    globals()["_LIB"] = define_op(
        NAMESPACE, OP_NAME, f"Tensor hidden, Tensor top_k_index, Tensor top_k_weights, {projections}, "
        "int[] act_quant, int activation, float limit, float alpha", "a", experts_ref, fake)


if not hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
    _define()


def _packed(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """One projection of every expert, stacked: (weights [E, out, in], group scales or None, biases or None, act
    quant). Every expert must hold it the same way (one scheme and group)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor
    ws = [m.weight for m in linears]
    bias = torch.stack([m.bias.detach().float() for m in linears]) if linears[0].bias is not None else None
    if all(type(w) is IntxUnpackedToInt8Tensor for w in ws):
        layouts = {(w.target_dtype, tuple(w.block_size), w.activation_quantization) for w in ws}
        if len(layouts) != 1 or ws[0].block_size[0] != 1 or any(w.zero_point.abs().max() > 0 for w in ws):
            raise ValueError(f"experts: the experts' weights are quantized differently ({sorted(map(str, layouts))}) "
                             "or asymmetrically: give every expert's projection of one role the same scheme")
        q = torch.stack([w.qdata for w in ws])
        if ws[0].target_dtype == torch.int4 and q.shape[-1] % 2 == 0:
            q = pack4(q)  # half the bytes a decode step streams
        return (q, torch.stack([w.scale.float() for w in ws]), bias, ws[0].activation_quantization is not None)
    if any(isinstance(w, torch.Tensor) and type(w) not in (nn.Parameter, torch.Tensor) for w in ws):
        raise ValueError(f"experts: weights of {sorted({type(w).__name__ for w in ws})} have no packed form")
    return torch.stack([w.detach().float() for w in ws]), None, bias, False


class PackedExperts(nn.Module):
    """A layer's experts as the llmpipe::experts op takes them (the exported form of an ExpertBank)."""

    def __init__(self, bank: ExpertBank):
        super().__init__()
        first = bank[0]
        self.activation = ACTIVATIONS[first.activation]
        self.limit, self.alpha = first.limit, first.alpha
        # an ungated expert's gate arguments are up's own buffers (one constant in the program), which it never reads
        self.gate_from = "up" if first.activation in archs.UNGATED_ACTIVATIONS else "gate"
        self.act_quant = []
        for role in PROJECTIONS:
            if role == "gate" and self.gate_from == "up":
                continue
            w, s, b, aq = _packed([getattr(x, archs.EXPERT_LINEARS[role]) for x in bank])
            for part, t in (("w", w), ("s", s), ("b", b)):
                if t is None:  # a plain None, not a None buffer: torch.export miscounts those at the root
                    setattr(self, f"{role}_{part}", None)
                else:
                    self.register_buffer(f"{role}_{part}", t)
            self.act_quant.append(int(aq))
        if self.gate_from == "up":
            self.act_quant.insert(0, self.act_quant[0])

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        roles = (self.gate_from, "up", "down")
        parts = [getattr(self, f"{role}_{part}") for role in roles for part in ("w", "s", "b")]
        return torch.ops.llmpipe.experts(hidden, top_k_index, top_k_weights.float(), *parts, self.act_quant,
                                         self.activation, self.limit, self.alpha)


def replace_banks(model: nn.Module, form) -> int:
    """Replace every ExpertBank by form(bank), the form a backend's programs run (before torch.export); returns how
    many."""
    a = archs.of_model(model)
    count = 0
    for layer in a.decoder_layers(model) if a.experts is not None else ():
        block = a.mlp_module(layer)
        bank = getattr(block, a.experts.bank, None)
        if isinstance(bank, ExpertBank):
            setattr(block, a.experts.bank, form(bank))
            count += 1
    return count


def pack_experts(model: nn.Module) -> int:
    """Every ExpertBank as PackedExperts (llmpipe::experts); returns how many."""
    return replace_banks(model, PackedExperts)


# --- the form on ExecuTorch's operators alone (cache.mode=stock): plain linears over every row -----------------
class DenseExperts(nn.Module):
    """A layer's experts without our op: every expert runs on every row and its output is weighted by the router's
    weight for it (0 where the row did not pick it), so no size is known only at run time and the linears lower as
    any other. A token pays for all E experts: E / top-k times the routed form's arithmetic and weight reads."""

    def __init__(self, bank: ExpertBank):
        super().__init__()
        self.bank = bank

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self.bank):  # in the bank's order, as ExpertBank sums them
            weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True).to(hidden.dtype)
            out = out + expert(hidden) * weight
        return out


def dense_experts(model: nn.Module) -> int:
    """Every ExpertBank as DenseExperts (ExecuTorch's operators alone); returns how many."""
    return replace_banks(model, DenseExperts)
