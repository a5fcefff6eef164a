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

    @property
    def smallest_window(self) -> Optional[int]:
        return self.sliding_window if "sliding_attention" in self.layer_types else None

    def linears(self) -> dict[str, int]:
        """Every linear's module name (HF's Llama / Gemma layout) and its in_features."""
        out = {}
        for i in range(self.num_layers):
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[f"model.layers.{i}.self_attn.{proj}"] = self.num_heads * self.head_dim if proj == "o_proj" \
                    else self.hidden_size
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[f"model.layers.{i}.mlp.{proj}"] = self.intermediate_size if proj == "down_proj" \
                    else self.hidden_size
        out["lm_head"] = self.hidden_size
        return out

    def linear_in_features(self) -> dict[str, int]:
        """in_features of each kind of linear in a decoder layer, plus lm_head."""
        return {
            "q_proj/k_proj/v_proj": self.hidden_size,
            "o_proj": self.num_heads * self.head_dim,
            "gate_proj/up_proj": self.hidden_size,
            "down_proj": self.intermediate_size,
            "lm_head": self.hidden_size,
        }


def layer_types(cfg) -> list[str]:
    """Each layer's attention type, from an HF config (a dict or a config object)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    n = get("num_hidden_layers")
    if get("layer_types"):
        return list(get("layer_types"))
    if get("sliding_window") and get("model_type", "") not in ("llama",):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def from_hf_config(cfg: dict) -> Geometry:
    heads = cfg["num_attention_heads"]
    sliding = cfg.get("sliding_window")
    types = layer_types(cfg)
    return Geometry(
        arch=cfg.get("model_type", "?"),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        layer_types=types,
        sliding_window=sliding if "sliding_attention" in types else None,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
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
