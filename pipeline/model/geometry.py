"""Model geometry read cheaply before any heavy work, so preflight can check group sizes and windows.

Sources: a tiny random config, a local config.json, or the metadata header of a GGUF file (read as a
stream, so a GGUF split over several package chunks needs only its first chunk).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Optional

from pipeline.model import archs


@dataclass
class Geometry:
    arch: str                                              # the HF model_type: its entry in pipeline/model/archs
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_types: list[str] = field(default_factory=list)   # archs.ATTENTION_KINDS or archs.RECURRENT_KINDS
    sliding_window: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    tie_word_embeddings: bool = True
    # per layer (empty = every layer has head_dim / num_kv_heads and its own K/V)
    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    kv_source: list[int] = field(default_factory=list)     # the layer whose K/V each layer attends over
    k_eq_v_layers: list[int] = field(default_factory=list)  # layers whose values are their keys (no v_proj)
    per_layer_input: int = 0                               # Gemma 4's per-layer input embedding width
    wide_mlp_layers: list[int] = field(default_factory=list)  # layers whose MLP is twice intermediate_size
    # mixture of experts: experts per MoE layer, how many a token runs, each expert's width, the dense layers
    num_experts: int = 0
    experts_per_token: int = 0
    expert_width: int = 0
    shared_expert_width: int = 0  # a shared expert beside the routed ones (0: none)
    dense_mlp_layers: list[int] = field(default_factory=list)
    # recurrent layers: a Gated DeltaNet's key / value heads and dims and its conv kernel; a short conv's kernel
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    delta_conv_kernel: int = 0
    conv_kernel: int = 0
    # Mamba-2 layers: heads, head dim, B/C groups, state size, conv kernel
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mamba_conv_kernel: int = 0
    problems: list = field(default_factory=list)           # (config key, value, why) the entry cannot build
    # longrope: past this length HF rotates every position with the long factors (and re-runs the whole sequence),
    # which a cache built position by position cannot follow: the context must stay within it
    rotary_switch: Optional[int] = None

    @property
    def entry(self) -> archs.Arch:
        return archs.lookup(self.arch)

    @property
    def smallest_window(self) -> Optional[int]:
        return self.sliding_window if "sliding_attention" in self.layer_types else None

    def layer_head_dim(self, i: int) -> int:
        return self.layer_head_dims[i] if self.layer_head_dims else self.head_dim

    def layer_kv_head_count(self, i: int) -> int:
        return self.layer_kv_heads[i] if self.layer_kv_heads else self.num_kv_heads

    def shares_kv(self, i: int) -> bool:
        return bool(self.kv_source) and self.kv_source[i] != i

    def has_experts(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_mlp_layers

    @property
    def recurrent(self) -> bool:
        """Has layers with a recurrent state (which a step cannot take back)."""
        return any(t in archs.STATE_KINDS for t in self.layer_types)

    def kind(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def delta_conv_channels(self) -> int:
        """A Gated DeltaNet layer's conv channels: q, k (key heads x key dim each) and v (value heads x value dim)."""
        return 2 * self.delta_key_heads * self.delta_key_dim + self.delta_value_heads * self.delta_value_dim

    @property
    def mamba_conv_channels(self) -> int:
        """A Mamba-2 layer's conv channels: x (heads x head dim), then B and C (groups x state size each)."""
        return self.mamba_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state

    def state_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """A recurrent layer's state: its conv's last kernel - 1 inputs and, for a Gated DeltaNet or a Mamba-2 layer,
        the fp32 matrix per head; {} for an attention layer (its K/V cache: kv_layout)."""
        kind = self.kind(i)
        if kind == "linear_attention":
            return {"conv": (self.delta_conv_kernel - 1, self.delta_conv_channels),
                    "delta": (self.delta_value_heads, self.delta_key_dim, self.delta_value_dim)}
        if kind == "conv":
            return {"conv": (self.conv_kernel - 1, self.hidden_size)}
        if kind in ("mamba", "hybrid"):
            return {"conv": (self.mamba_conv_kernel - 1, self.mamba_conv_channels),
                    "delta": (self.mamba_heads, self.mamba_state, self.mamba_head_dim)}
        return {}

    def linear_specs(self) -> dict[str, tuple[int, int, str]]:
        """Every linear's module name (as the architecture's entry lays the model out), (out_features, in_features)
        and role (archs.ROLES)."""
        a, h, out = self.entry, self.hidden_size, {}
        for i in range(self.num_layers):
            kind = self.kind(i)
            if kind not in archs.MLP_KINDS:
                out.update(self._delta_linears(a, i) if kind == "linear_attention" else
                           self._conv_linears(a, i) if kind == "conv" else
                           self._mamba_linears(a, i) if kind == "mamba" else self._attention_linears(a, i))
            if kind == "hybrid":
                out.update(self._mamba_linears(a, i))
            if a.has_mlp(kind):
                out.update(self._mlp_linears(a, i))
            if self.per_layer_input:
                out[f"{a.layers}.{i}.per_layer_input_gate"] = (self.per_layer_input, h, "per_layer")
                out[f"{a.layers}.{i}.per_layer_projection"] = (h, self.per_layer_input, "per_layer")
        if self.per_layer_input:
            out["model.per_layer_model_projection"] = (self.num_layers * self.per_layer_input, h, "per_layer")
        out["lm_head"] = (self.vocab_size, h, "lm_head")
        return out

    def _attention_linears(self, a: archs.Arch, i: int) -> dict:
        at, h = a.attention, self.hidden_size
        p = f"{a.layers}.{i}.{at.path}."
        q, kv = self.num_heads * self.layer_head_dim(i), self.layer_kv_head_count(i) * self.layer_head_dim(i)
        q_rows = 2 * q if at.output_gate else q
        if at.qkv:
            projs = {at.qkv: (q_rows + 2 * kv, "qkv")}
        elif self.shares_kv(i):
            projs = {at.q: (q_rows, "q")}
        else:
            projs = {at.q: (q_rows, "q"), at.k: (kv, "k"), **({} if i in self.k_eq_v_layers else {at.v: (kv, "v")})}
        out = {p + name: (n_out, h, role) for name, (n_out, role) in projs.items()}
        out[p + at.o] = (h, q, "o")
        return out

    def _delta_linears(self, a: archs.Arch, i: int) -> dict:
        d, h = a.gated_delta, self.hidden_size
        p = f"{a.layers}.{i}.{d.path}."
        v = self.delta_value_heads * self.delta_value_dim
        gates = self.delta_value_heads
        return {p + d.qkv: (self.delta_conv_channels, h, "delta_qkv"), p + d.z: (v, h, "delta_z"),
                p + d.b: (gates, h, "delta_gates"), p + d.a: (gates, h, "delta_gates"), p + d.out: (h, v, "delta_out")}

    def _conv_linears(self, a: archs.Arch, i: int) -> dict:
        c, h = a.short_conv, self.hidden_size
        p = f"{a.layers}.{i}.{c.path}."
        return {p + c.in_proj: (3 * h, h, "conv_in"), p + c.out: (h, h, "conv_out")}

    def _mamba_linears(self, a: archs.Arch, i: int) -> dict:
        m, h = a.mamba2, self.hidden_size
        p, inner = f"{a.layers}.{i}.{m.path}.", self.mamba_heads * self.mamba_head_dim
        return {p + m.in_proj: (inner + self.mamba_conv_channels + self.mamba_heads, h, "ssm_in"),
                p + m.out: (h, inner, "ssm_out")}

    def _mlp_linears(self, a: archs.Arch, i: int) -> dict:
        m, h = a.mlp, self.hidden_size
        p = f"{a.layers}.{i}.{m.path}."
        if self.has_experts(i):
            w = self.expert_width
            shapes = {"gate": (w, h), "up": (w, h), "down": (h, w)}
            out = {f"{p}{a.experts.bank}.{e}.{name}": (*shapes[role], role)
                   for e in range(self.num_experts)
                   for role, name in archs.expert_linears(a.experts.activation).items()}
            if a.experts.router_linear:
                out[f"{p}{a.experts.router}.{a.experts.router_linear}"] = (self.num_experts, h, "router")
            if a.experts.shared and self.shared_expert_width:  # ERNIE 4.5 may have none
                s = f"{a.layers}.{i}." if a.experts.shared_in_layer else p
                s, sw = f"{s}{a.experts.shared}.", self.shared_expert_width
                ins = {s + m.gate_up: (2 * sw, h, "gate_up")} if m.gate_up else \
                    {s + m.gate: (sw, h, "gate"), s + m.up: (sw, h, "up")} if m.gate else {s + m.up: (sw, h, "up")}
                out.update({**ins, s + m.down: (h, sw, "down")})
                if a.experts.shared_gate:
                    out[p + a.experts.shared_gate] = (1, h, "shared_gate")
            return out
        width = self.intermediate_size * (2 if i in self.wide_mlp_layers else 1)
        ins = {p + m.gate_up: (2 * width, h, "gate_up")} if m.gate_up else \
            {p + m.gate: (width, h, "gate"), p + m.up: (width, h, "up")} if m.gate else {p + m.up: (width, h, "up")}
        return {**ins, p + m.down: (h, width, "down")}

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Every linear's module name and its (out_features, in_features)."""
        return {name: (n_out, n_in) for name, (n_out, n_in, _) in self.linear_specs().items()}

    def linear_roles(self) -> dict[str, str]:
        return {name: role for name, (_, _, role) in self.linear_specs().items()}

    def recurrent_parameters(self) -> int:
        """The recurrent layers' float parameters beside their linears: conv weights; a Gated DeltaNet's A_log,
        dt_bias and gated norm."""
        total = 0
        for i in range(self.num_layers):
            if self.kind(i) == "linear_attention":
                total += self.delta_conv_channels * self.delta_conv_kernel + 2 * self.delta_value_heads \
                    + self.delta_value_dim
            elif self.kind(i) == "conv":
                total += self.hidden_size * self.conv_kernel
            elif self.kind(i) in ("mamba", "hybrid"):  # conv weights and bias; A_log, dt_bias, D; the gated norm
                total += self.mamba_conv_channels * (self.mamba_conv_kernel + 1) + 3 * self.mamba_heads \
                    + self.mamba_heads * self.mamba_head_dim
        return total

    def state_bytes(self, dtype_bytes: int) -> int:
        """The recurrent layers' state: the conv's in the activations' dtype, a Gated DeltaNet's matrix in fp32."""
        return sum(math.prod(shape) * (4 if name == "delta" else dtype_bytes)
                   for i in range(self.num_layers) for name, shape in self.state_shapes(i).items())

    def router_parameters(self) -> int:
        """The MoE routers' weights (kept in float; those held as linears are counted with the linears)."""
        experts = archs.lookup(self.arch).experts
        if experts is None or experts.router_linear:
            return 0
        return sum(self.num_experts * (self.hidden_size + 1) for i in range(self.num_layers) if self.has_experts(i))

    def linears(self) -> dict[str, int]:
        """Every linear's module name and its in_features."""
        return {name: n_in for name, (_, n_in) in self.linear_shapes().items()}

    def linear_in_features(self) -> dict[str, int]:
        """in_features of each role of linear (the distinct values per role; q/k/v and gate/up read one input)."""
        kinds = {"q": "q/k/v", "k": "q/k/v", "v": "q/k/v", "gate": "gate/up", "up": "gate/up"}
        out: dict[str, int] = {}
        for name, (_, n, role) in self.linear_specs().items():
            kind = kinds.get(role, role)
            key = kind if out.get(kind, n) == n else f"{kind} ({name})"
            out[key] = n
        return out


def text_config(cfg: dict) -> dict:
    """The text part of an HF config dict: a multimodal checkpoint nests it under `text_config`."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def hf_config(cfg: dict):
    """The HF config object of a config dict's text part, as transformers normalizes it (layer_types, rope
    parameters, use_sliding_window); no weights. Refuses a model_type outside the registry first."""
    cfg = dict(text_config(cfg))
    model_type = cfg.pop("model_type", None)
    archs.lookup(model_type)
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **cfg)


def kv_sources(types: list[str], n_shared: int) -> list[int]:
    """The layer whose K/V each layer attends over: itself, or, for the last `n_shared` layers (Gemma 4's
    num_kv_shared_layers), the last non-shared layer of the same attention type."""
    n = len(types)
    first = n - n_shared
    out = list(range(n))
    for i in range(first, n):
        same = [j for j in range(first) if types[j] == types[i]]
        if not same:
            raise ValueError(f"num_kv_shared_layers={n_shared}: shared layer {i} ({types[i]}) has no earlier "
                             f"non-shared layer of its type among the first {first}")
        out[i] = same[-1]
    return out


def layer_types(config) -> list[str]:
    """Each layer's attention kind, from an HF text config object, as its architecture's entry reads it."""
    return archs.lookup(config.model_type).layer_kinds(config)


def from_hf_config(cfg: dict) -> Geometry:
    """The geometry of an HF config dict (config.json's contents, or a tiny random model's)."""
    return from_config(hf_config(cfg))


def from_config(config) -> Geometry:
    """The geometry of an HF text config object, as its architecture's entry reads it."""
    a = archs.lookup(config.model_type)
    types = a.layer_kinds(config)
    n, heads = config.num_hidden_layers, config.num_attention_heads
    first = layer_config(config, 0)  # a heterogeneous config (Gemma 4) answers per layer only
    head_dim, kv_heads = a.head_dim(first), getattr(first, "num_key_value_heads", None) or heads
    extra = _per_layer(a, config, types) if a.per_layer else {}
    if a.experts is not None:
        x = a.experts
        shared = (x.shared_width(config) if x.shared_width else getattr(config, x.shared_width_key)) if x.shared else 0
        extra.update(num_experts=getattr(config, x.count_key), experts_per_token=getattr(config, x.top_k_key),
                     expert_width=getattr(config, x.width_key), dense_mlp_layers=list(x.dense_layers(config)),
                     shared_expert_width=shared)
    if a.gated_delta is not None:
        d = a.gated_delta
        extra.update(delta_key_heads=getattr(config, d.key_heads_key),
                     delta_value_heads=getattr(config, d.value_heads_key), delta_key_dim=getattr(config, d.key_dim_key),
                     delta_value_dim=getattr(config, d.value_dim_key), delta_conv_kernel=getattr(config, d.kernel_key))
    if a.short_conv is not None:
        extra.update(conv_kernel=getattr(config, a.short_conv.kernel_key))
    if a.mamba2 is not None:
        m = a.mamba2
        extra.update(mamba_heads=getattr(config, m.heads_key), mamba_head_dim=getattr(config, m.head_dim_key),
                     mamba_groups=getattr(config, m.groups_key), mamba_state=getattr(config, m.state_key),
                     mamba_conv_kernel=getattr(config, m.kernel_key))
    window = getattr(config, "sliding_window", None)
    width = a.mlp.width(config) if a.mlp.width else getattr(config, a.mlp.width_key)
    return Geometry(
        arch=a.model_type, hidden_size=config.hidden_size, intermediate_size=width,
        num_layers=n, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=config.vocab_size,
        layer_types=types, sliding_window=window if "sliding_attention" in types else None,
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)), problems=a.problems(config),
        rotary_switch=_longrope_switch(config), **extra)


def _longrope_switch(config) -> Optional[int]:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    return params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)


def layer_config(config, i: int):
    """Layer i's view of a heterogeneous config (Gemma 4's per_layer_config: global layers' own head dim and KV
    heads), or the config itself."""
    return config.per_layer_config[i] if hasattr(config, "per_layer_config") else config


def _per_layer(a: archs.Arch, config, types: list[str]) -> dict:
    """Gemma 4's per-layer geometry: each layer's head dim and KV heads (per_layer_config); values = keys on global
    layers; trailing layers that share an earlier layer's K/V; per-layer input embeddings; double-wide shared MLPs."""
    p, n = a.per_layer, len(types)
    src = kv_sources(types, getattr(config, p.kv_shared_key, 0) or 0)
    k_eq_v = bool(getattr(config, p.k_eq_v_key, False))
    return dict(layer_head_dims=[a.head_dim(layer_config(config, i)) for i in range(n)],
                layer_kv_heads=[layer_config(config, i).num_key_value_heads for i in range(n)],
                kv_source=src, k_eq_v_layers=[i for i, t in enumerate(types) if t == "full_attention"] if k_eq_v else [],
                per_layer_input=getattr(config, p.input_width_key, 0) or 0,
                wide_mlp_layers=[i for i in range(n) if src[i] != i] if getattr(config, p.double_wide_key, False)
                else [])


def from_config_json(path: Path) -> Geometry:
    return from_hf_config(json.loads(Path(path).read_text()))


# --- GGUF metadata header --------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _ChainedReader:
    """Reads a sequence of files as one stream (GGUF files shipped in chunks)."""

    def __init__(self, paths: list[Path]):
        self.paths, self.i, self.f = list(paths), 0, open(paths[0], "rb")

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.f.read(n - len(out))
            if chunk:
                out += chunk
                continue
            self.f.close()
            self.i += 1
            if self.i >= len(self.paths):
                raise EOFError("GGUF header truncated")
            self.f = open(self.paths[self.i], "rb")
        return out

    def close(self):
        self.f.close()


def _read_value(r: BinaryIO, vtype: int, keep_arrays: bool):
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, r.read(struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        (n,) = struct.unpack("<Q", r.read(8))
        return r.read(n).decode("utf-8", errors="replace")
    if vtype == _ARRAY:
        itype, count = struct.unpack("<IQ", r.read(12))
        items = [_read_value(r, itype, keep_arrays) for _ in range(count)]
        return items if keep_arrays else len(items)
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf_metadata(paths: list[Path]) -> dict:
    """Key/value metadata of a GGUF file; arrays are replaced by their length."""
    r = _ChainedReader(paths)
    try:
        if r.read(4) != b"GGUF":
            raise ValueError(f"{paths[0]} is not a GGUF file")
        _version, _n_tensors, n_kv = struct.unpack("<IQQ", r.read(20))
        meta = {}
        for _ in range(n_kv):
            (klen,) = struct.unpack("<Q", r.read(8))
            key = r.read(klen).decode()
            (vtype,) = struct.unpack("<I", r.read(4))
            meta[key] = _read_value(r, vtype, keep_arrays=False)
        return meta
    finally:
        r.close()


def from_gguf(paths: list[Path]) -> Geometry:
    m = read_gguf_metadata(paths)
    arch = m["general.architecture"]
    g = lambda k, d=None: m.get(f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    head_dim = g("attention.key_length") or hidden // heads
    n = g("block_count")
    window = g("attention.sliding_window")
    entry = archs.for_gguf(arch)
    types = entry.gguf_layer_types(n, window) if entry.gguf_layer_types else ["full_attention"] * n
    vocab = g("vocab_size") or m.get("tokenizer.ggml.tokens")
    return Geometry(
        arch=entry.model_type, hidden_size=hidden, intermediate_size=g("feed_forward_length"), num_layers=n,
        num_heads=heads, num_kv_heads=g("attention.head_count_kv", heads), head_dim=head_dim,
        vocab_size=vocab, layer_types=types, sliding_window=window if window else None,
        max_position_embeddings=g("context_length"),
    )
