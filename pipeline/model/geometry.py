"""Model geometry read cheaply before any heavy work, so preflight can check group sizes and windows.

Sources: a tiny random config, a local config.json, or the metadata header of a GGUF file (read as a
stream, so a GGUF split over several package chunks needs only its first chunk).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Optional


@dataclass
class Geometry:
    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_types: list[str] = field(default_factory=list)   # "full_attention" | "sliding_attention"
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

    @property
    def smallest_window(self) -> Optional[int]:
        return self.sliding_window if "sliding_attention" in self.layer_types else None

    def layer_head_dim(self, i: int) -> int:
        return self.layer_head_dims[i] if self.layer_head_dims else self.head_dim

    def layer_kv_head_count(self, i: int) -> int:
        return self.layer_kv_heads[i] if self.layer_kv_heads else self.num_kv_heads

    def shares_kv(self, i: int) -> bool:
        return bool(self.kv_source) and self.kv_source[i] != i

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Every linear's module name (HF's Llama / Gemma layout) and its (out_features, in_features)."""
        h, out = self.hidden_size, {}
        for i in range(self.num_layers):
            q, kv = self.num_heads * self.layer_head_dim(i), self.layer_kv_head_count(i) * self.layer_head_dim(i)
            projs = {"q_proj": q} if self.shares_kv(i) else \
                {"q_proj": q, "k_proj": kv, **({} if i in self.k_eq_v_layers else {"v_proj": kv})}
            for proj, n_out in projs.items():
                out[f"model.layers.{i}.self_attn.{proj}"] = (n_out, h)
            out[f"model.layers.{i}.self_attn.o_proj"] = (h, q)
            width = self.intermediate_size * (2 if i in self.wide_mlp_layers else 1)
            out[f"model.layers.{i}.mlp.gate_proj"] = out[f"model.layers.{i}.mlp.up_proj"] = (width, h)
            out[f"model.layers.{i}.mlp.down_proj"] = (h, width)
            if self.per_layer_input:
                out[f"model.layers.{i}.per_layer_input_gate"] = (self.per_layer_input, h)
                out[f"model.layers.{i}.per_layer_projection"] = (h, self.per_layer_input)
        if self.per_layer_input:
            out["model.per_layer_model_projection"] = (self.num_layers * self.per_layer_input, h)
        out["lm_head"] = (self.vocab_size, h)
        return out

    def linears(self) -> dict[str, int]:
        """Every linear's module name and its in_features."""
        return {name: n_in for name, (_, n_in) in self.linear_shapes().items()}

    def linear_in_features(self) -> dict[str, int]:
        """in_features of each kind of linear (the distinct values per kind), plus lm_head."""
        kinds = {"q_proj": "q_proj/k_proj/v_proj", "k_proj": "q_proj/k_proj/v_proj", "v_proj": "q_proj/k_proj/v_proj",
                 "gate_proj": "gate_proj/up_proj", "up_proj": "gate_proj/up_proj"}
        out: dict[str, int] = {}
        for name, n in self.linears().items():
            kind = kinds.get(name.rsplit(".", 1)[-1], name.rsplit(".", 1)[-1])
            key = kind if out.get(kind, n) == n else f"{kind} ({name})"
            out[key] = n
        return out


def layer_types(cfg) -> list[str]:
    """Each layer's attention type, from an HF config (a dict or a config object)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    n = get("num_hidden_layers")
    if get("layer_types"):
        return list(get("layer_types"))
    if get("sliding_window") and get("model_type", "") not in ("llama",):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


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


def text_config(cfg: dict) -> dict:
    """The text part of an HF config dict: a multimodal checkpoint nests it under `text_config`."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def from_hf_config(cfg: dict) -> Geometry:
    cfg = text_config(cfg)
    heads = cfg["num_attention_heads"]
    sliding = cfg.get("sliding_window")
    types = layer_types(cfg)
    n = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    extra = {}
    if cfg.get("model_type") == "gemma4_text":
        # HF's Gemma4TextConfig: full-attention layers take global_head_dim (default 512) and, with
        # attention_k_eq_v, num_global_key_value_heads; their values are their keys
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        g_dim = cfg.get("global_head_dim", 512)
        g_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        n_shared = cfg.get("num_kv_shared_layers", 0) or 0
        src = kv_sources(types, n_shared)
        dims = [g_dim if i in full else head_dim for i in range(n)]
        kvs = [(g_kv or kv_heads) if i in full else kv_heads for i in range(n)]
        # a config.json saved by transformers >= 5.23 holds the per-layer overrides themselves ({"05": {...}})
        for key, over in (cfg.get("per_layer_config") or {}).items():
            i = int(key)
            dims[i] = over.get("head_dim", head_dim)
            kvs[i] = over.get("num_key_value_heads", kv_heads)
        extra = dict(layer_head_dims=dims, layer_kv_heads=kvs,
                     kv_source=src, k_eq_v_layers=full if k_eq_v else [],
                     per_layer_input=cfg.get("hidden_size_per_layer_input", 256) or 0,
                     wide_mlp_layers=[i for i in range(n) if src[i] != i] if cfg.get("use_double_wide_mlp") else [])
    return Geometry(
        arch=cfg.get("model_type", "?"),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        layer_types=types,
        sliding_window=sliding if "sliding_attention" in types else None,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        **extra,
    )


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
    if arch == "gemma3" and window:
        # Gemma 3: every 6th layer is global attention (sliding_window_pattern = 6)
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    else:
        types = ["full_attention"] * n
    vocab = g("vocab_size") or m.get("tokenizer.ggml.tokens")
    return Geometry(
        arch=arch, hidden_size=hidden, intermediate_size=g("feed_forward_length"), num_layers=n,
        num_heads=heads, num_kv_heads=g("attention.head_count_kv", heads), head_dim=head_dim,
        vocab_size=vocab, layer_types=types, sliding_window=window if window else None,
        max_position_embeddings=g("context_length"),
    )
