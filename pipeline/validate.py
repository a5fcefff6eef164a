"""Preflight: every cross-field rule, checked before any download or build; all problems in one error.

Hydra has already rejected unknown keys, unknown group choices and bad Enum values at composition.
"""
from __future__ import annotations

from typing import Optional

from pipeline.config import BackendName, CacheMode, EmbeddingScheme, LinearScheme, v
from pipeline.errors import ConfigError, PipelineError
from pipeline.geometry import Geometry
from pipeline.paths import OUTPUTS_ROOT, is_inside_outputs

LINEAR = [s.value for s in LinearScheme]
EMBEDDING = [s.value for s in EmbeddingScheme]
IMPLEMENTED_CACHE_MODES = {"static", "custom", "offgraph"}
IMPLEMENTED_BACKENDS = {"xnnpack", "portable"}
# (scheme, backend) pairs known to produce wrong programs, with the reason; preflight refuses them.
# (4w/8w on xnnpack were here until pipeline/backends/xnnpack_woq.py made them correct.)
UNSAFE: dict[tuple[str, str], str] = {}


def check(cfg, geometry_fn=None) -> Optional[Geometry]:
    """Raise ConfigError listing every problem; returns the model geometry when it could be read."""
    problems: list[tuple[str, object, str]] = []
    add = lambda key, value, why: problems.append((key, value, why))  # noqa: E731
    q, e, c, b, vc = cfg.quantize, cfg.export, cfg.cache, cfg.backend, cfg.verify
    backend, mode = v(b.name), v(c.mode)

    # quantization choices and backend pairing
    if v(q.linear) not in LINEAR:
        add("quantize.linear", v(q.linear), f"allowed: {LINEAR}")
    if v(q.embedding) not in EMBEDDING:
        add("quantize.embedding", v(q.embedding), f"allowed: {EMBEDDING}")
    for key, scheme in (("quantize.linear", v(q.linear)), ("quantize.embedding", v(q.embedding))):
        if scheme == "nvfp4" and backend != BackendName.mlx.value:
            add(key, scheme, f"nvfp4 is for backend=mlx only (backend.name={backend!r})")
    if (v(q.linear), backend) in UNSAFE:
        add("quantize.linear", v(q.linear), UNSAFE[(v(q.linear), backend)])
    for key, group in (("quantize.linear_group_size", q.linear_group_size),
                       ("quantize.embedding_group_size", q.embedding_group_size)):
        if group < 0:
            add(key, group, "must be >= 0 (0 = per channel)")
    for key, scheme, group in (("quantize.linear_group_size", v(q.linear), q.linear_group_size),
                               ("quantize.embedding_group_size", v(q.embedding), q.embedding_group_size)):
        if scheme == "nvfp4" and group != 16:
            add(key, group, "nvfp4 uses group size 16")

    # cache mode
    if mode == CacheMode.offgraph.value and (c.custom_sdpa or c.custom_kv_cache):
        add("cache.custom_sdpa/custom_kv_cache", [c.custom_sdpa, c.custom_kv_cache],
            "cache.mode=offgraph owns attention and the cache itself: the custom-op flags must be false")
    if mode == CacheMode.static.value and (c.custom_sdpa or c.custom_kv_cache):
        add("cache.custom_sdpa/custom_kv_cache", [c.custom_sdpa, c.custom_kv_cache],
            "the custom-op flags need cache.mode=custom")
    if mode == CacheMode.custom.value and not (c.custom_sdpa and c.custom_kv_cache):
        add("cache.custom_sdpa/custom_kv_cache", [c.custom_sdpa, c.custom_kv_cache],
            "cache.mode=custom is one fused op that updates the cache and attends: both flags must be true")
    if mode not in IMPLEMENTED_CACHE_MODES:
        add("cache.mode", mode, f"not available in this build yet; available: {sorted(IMPLEMENTED_CACHE_MODES)}")
    if backend not in IMPLEMENTED_BACKENDS:
        add("backend.name", backend, f"not available in this build yet; available: {sorted(IMPLEMENTED_BACKENDS)}")

    # export sizes
    if e.max_context_len < 2:
        add("export.max_context_len", e.max_context_len, "must be >= 2")
    if e.prefill_chunk < 1:
        add("export.prefill_chunk", e.prefill_chunk, "must be >= 1")
    elif e.prefill_chunk > e.max_context_len:
        add("export.prefill_chunk", e.prefill_chunk,
            f"must be in [1, export.max_context_len={e.max_context_len}]")

    # verify
    if vc.max_new_tokens < 1:
        add("verify.max_new_tokens", vc.max_new_tokens, "must be >= 1")
    if vc.enabled and not list(vc.prompts):
        add("verify.prompts", [], "needs at least one prompt when verify.enabled=true")

    rt = vc.runtime
    changed = [k for k, default in (("kv_max_capacity", None), ("kv_initial_capacity", 512), ("kv_windows", None),
                                    ("kv_storage_dtype", None)) if rt[k] != default]
    if changed and mode != CacheMode.offgraph.value:
        add("verify.runtime." + changed[0], v(rt[changed[0]]), f"runtime cache parameters need cache.mode=offgraph "
            f"(cache.mode={mode!r} keeps its cache in the program)")
    if rt.kv_max_capacity is not None and not 1 <= rt.kv_max_capacity <= e.max_context_len:
        add("verify.runtime.kv_max_capacity", rt.kv_max_capacity,
            f"must be in [1, export.max_context_len={e.max_context_len}] (null = the max context)")
    if rt.kv_initial_capacity < 1:
        add("verify.runtime.kv_initial_capacity", rt.kv_initial_capacity, "must be >= 1")
    if rt.kv_windows is not None and (not list(rt.kv_windows) or any(w < 0 for w in rt.kv_windows)):
        add("verify.runtime.kv_windows", list(rt.kv_windows),
            "a non-empty list of windows >= 0 (0 = flat), repeated over the caches")

    from pipeline.stages import ORDER
    if cfg.run.until is not None and cfg.run.until not in ORDER:
        add("run.until", cfg.run.until, f"allowed: {list(ORDER)}")

    # paths
    if not is_inside_outputs(cfg.run.output_dir):
        add("run.output_dir", cfg.run.output_dir, f"must be inside {OUTPUTS_ROOT}")

    # rules that need the model's geometry (read from config/GGUF header, never the weights)
    geometry = None
    try:
        from pipeline import sources
        geometry = (geometry_fn or sources.geometry)(cfg.model)
    except PipelineError as err:
        add(_source_key(cfg.model), _source_value(cfg.model), str(err).split(": ", 1)[-1])
    if geometry is not None:
        problems += geometry_problems(cfg, geometry)
    if problems:
        raise ConfigError(problems)
    return geometry


def geometry_problems(cfg, g: Geometry) -> list[tuple[str, object, str]]:
    q, e = cfg.quantize, cfg.export
    out = []
    window = g.smallest_window
    ceiling = min(e.max_context_len, window) if window else e.max_context_len
    if window and e.prefill_chunk > window:
        out.append(("export.prefill_chunk", e.prefill_chunk,
                    f"must be in [1, {ceiling}] = min(export.max_context_len, smallest sliding window "
                    f"{window}): a ring layer holds window + chunk - 1 slots"))
    if v(q.linear) != "none" and q.linear_group_size > 0:
        bad = {name: n for name, n in g.linear_in_features().items() if n % q.linear_group_size}
        if bad:
            out.append(("quantize.linear_group_size", q.linear_group_size,
                        "must divide the in_features of every linear; it does not divide "
                        + ", ".join(f"{k} ({n})" for k, n in bad.items())
                        + f"; divisors that work: {_common_divisors(g.linear_in_features().values())}"))
    if v(q.embedding) != "none" and q.embedding_group_size > 0 and g.hidden_size % q.embedding_group_size:
        out.append(("quantize.embedding_group_size", q.embedding_group_size,
                    f"must divide the embedding dim {g.hidden_size}; divisors that work: "
                    f"{_common_divisors([g.hidden_size])}"))
    if g.max_position_embeddings and e.max_context_len > g.max_position_embeddings:
        out.append(("export.max_context_len", e.max_context_len,
                    f"exceeds the model's max_position_embeddings {g.max_position_embeddings}"))
    return out


def _common_divisors(values) -> list[int]:
    vals = list(values)
    return [d for d in (16, 32, 64, 128, 256) if all(x % d == 0 for x in vals)]


def _source_key(m) -> str:
    return {"gguf": "model.path" if m.path else "model.package", "local": "model.path",
            "hf": "model.repo_id", "random": "model.random"}.get(v(m.source), "model.source")


def _source_value(m):
    return {"gguf": m.path or m.package, "local": m.path, "hf": f"{m.repo_id}@{m.revision}",
            "random": "..."}.get(v(m.source), v(m.source))
