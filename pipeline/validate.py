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
IMPLEMENTED_BACKENDS = {"xnnpack", "portable", "mlx"}
# (scheme, backend) pairs known to produce wrong programs, with the reason; preflight refuses them.
# (4w/8w on xnnpack were here until pipeline/backends/xnnpack_woq.py made them correct.)
UNSAFE: dict[tuple[str, str], str] = {
    ("8da4w", "mlx"): "backend=mlx allowed: ['none', '4w', '8w', 'nvfp4'] (the MLX partitioner does not take "
                      "torchao's dynamic activation quantization: choose_qparams_affine / quantize_affine / "
                      "dequantize_affine stay outside the delegate and have no out variants, so lowering fails "
                      "with 'Missing out variants')",
}


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

    if backend == BackendName.mlx.value and vc.enabled and vc.native:
        add("verify.native", vc.native, "backend=mlx programs need the MLX runtime (Apple Silicon); the C++ runner "
            "here cannot run them: set verify.native=false (verify runs them through pipeline.mlx_interpreter)")
    if vc.batched and (mode != CacheMode.offgraph.value or not vc.native):
        add("verify.batched", vc.batched, f"the batched check runs llm_batched_runner on an off-graph program against "
            f"the single-session C++ runs: needs cache.mode=offgraph (is {mode!r}) and verify.native=true")
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

    problems += hf_exporter_problems(cfg)

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
        problems += hf_exporter_geometry_problems(cfg, geometry)
    if problems:
        raise ConfigError(problems)
    return geometry


# --- export.exporter=transformers (pipeline/hf_exporter.py, pipeline/hf_runtime.py) --------------------------------
HF_EXPORTER_BACKENDS = ["xnnpack", "mlx"]
HF_EXPORTER_WHY_NOT = {
    "portable": "the exporter has no portable backend (its backends: xnnpack, cuda, mlx)",
}


def hf_exporter_problems(cfg) -> list[tuple[str, object, str]]:
    """What the transformers.exporters route can build and verify; nothing for export.exporter=native."""
    e, b, c, vc = cfg.export, cfg.backend, cfg.cache, cfg.verify
    if v(e.exporter) != "transformers":
        return []
    out = []
    route = "with export.exporter=transformers"
    backend = v(b.name)
    if backend not in HF_EXPORTER_BACKENDS:
        out.append(("backend.name", backend, f"{route} allowed: {HF_EXPORTER_BACKENDS} "
                                             f"({HF_EXPORTER_WHY_NOT.get(backend, 'not supported')})"))
    if v(c.mode) != CacheMode.static.value:
        out.append(("cache.mode", v(c.mode), f"{route} allowed: ['static'] (the exporter brings its own cache, passed "
                                             "in and out of the programs: xnnpack a StaticCache, mlx a DynamicCache; "
                                             "custom/offgraph are the native route's)"))
    if vc.native:
        out.append(("verify.native", vc.native, f"{route} allowed: [false]: the C++ runner runs the native one-program "
                                               "layout and cannot load prefill.pte + decode.pte with the KV cache as "
                                               "program input/output; verify runs them in the Python runtime"))
    if v(e.logits_mode) != "full":
        out.append(("export.logits_mode", v(e.logits_mode), f"{route} allowed: ['full'] (the exporter drops "
                                                            "logits_to_keep: prefill returns every row's logits)"))
    if e.strict:
        out.append(("export.strict", e.strict, f"{route} allowed: [false] (the exporter traces non-strict with its "
                                              "own patches; strict dynamo tracing fails on them)"))
    if v(e.dtype) != "fp32":
        out.append(("export.dtype", v(e.dtype), f"{route} allowed: ['fp32'] (the only dtype built and verified here)"))
    if e.prefill_chunk < 2:
        out.append(("export.prefill_chunk", e.prefill_chunk, f"{route} must be >= 2: the token count is traced "
                                                             "symbolic from a >= 2-token sample"))
    return out


def hf_exporter_geometry_problems(cfg, g: Geometry) -> list[tuple[str, object, str]]:
    if v(cfg.export.exporter) != "transformers" or not g.smallest_window:
        return []
    return [("export.exporter", "transformers", f"allowed for models without sliding-window layers only ({g.arch} "
             f"has window {g.smallest_window}): pipeline/hf_runtime.py runs one StaticCache mask per program, not "
             "the per-layer-type masks and ring layers of a sliding-window cache")]
# --- end export.exporter=transformers -----------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# memory estimates (preflight): from the geometry, never the weights
# --------------------------------------------------------------------------------------------------
# export + lower peak RSS over the fp32 weights; measured (one build per process): SmolLM2-135M (540 MB
# fp32) peaks at 3.2 GiB lowering fp32 and 2.1 GiB lowering 8da4w; gemma-3-270m (1.07 GB) 2.7 GiB (8da4w)
EXPORT_PEAK_OVER_WEIGHTS = 6.0
# export.exporter=transformers: SmolLM2 fp32 (prefill then decode, one model alive at a time) peaked at 4.3 GiB
EXPORT_PEAK_OVER_WEIGHTS_HF = 8.5
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def parameter_count(g: Geometry) -> int:
    attn = g.hidden_size * g.head_dim * (2 * g.num_heads + 2 * g.num_kv_heads)
    mlp = 3 * g.hidden_size * g.intermediate_size
    head = 0 if g.tie_word_embeddings else g.vocab_size * g.hidden_size
    return g.vocab_size * g.hidden_size + g.num_layers * (attn + mlp + 2 * g.hidden_size) + head


def kv_cache_bytes(cfg, g: Geometry) -> int:
    """K/V storage at the recipe's context: static keeps the whole context in every layer; custom and
    offgraph hold rings of window + chunk - 1 slots in sliding layers."""
    e = cfg.export
    per_slot = 2 * g.num_kv_heads * g.head_dim * DTYPE_BYTES[v(e.dtype)]
    types = g.layer_types or ["full_attention"] * g.num_layers
    total = 0
    for t in types:
        slots = e.max_context_len
        if t == "sliding_attention" and g.sliding_window and v(cfg.cache.mode) != CacheMode.static.value:
            slots = min(g.sliding_window + e.prefill_chunk - 1, e.max_context_len)
        total += slots * per_slot
    return total


def memory_estimate(cfg, g: Geometry) -> dict:
    weights = parameter_count(g) * 4  # export works on fp32 (or dequantized) weights
    ratio = EXPORT_PEAK_OVER_WEIGHTS_HF if v(cfg.export.exporter) == "transformers" else EXPORT_PEAK_OVER_WEIGHTS
    return {"params": parameter_count(g), "export_peak_bytes": int(weights * ratio),
            "kv_cache_bytes": kv_cache_bytes(cfg, g)}


def memory_problems(cfg, g: Geometry, total_bytes: int) -> list[tuple[str, object, str]]:
    est = memory_estimate(cfg, g)
    out = []
    if est["export_peak_bytes"] > total_bytes:
        out.append(("model", cfg.model.name, f"export needs about {est['export_peak_bytes'] / 2**30:.1f} GiB, "
                                              f"this machine has {total_bytes / 2**30:.1f} GiB"))
    if est["kv_cache_bytes"] > total_bytes / 4:
        out.append(("export.max_context_len", cfg.export.max_context_len,
                    f"the KV cache alone needs {est['kv_cache_bytes'] / 2**30:.2f} GiB (a quarter of this "
                    f"machine's {total_bytes / 2**30:.1f} GiB is the limit)"))
    return out


# --------------------------------------------------------------------------------------------------
# python -m pipeline.validate [DIR] [--smoke]: every recipe, no download, no build
# --------------------------------------------------------------------------------------------------
TINY_FOR_ARCH = {"llama": "tiny_llama", "gemma3": "tiny_gemma3", "gemma3_text": "tiny_gemma3"}


def _compose(name: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    from pipeline.paths import CONF_DIR
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[f"recipe={name}", *overrides])


def validate_recipe(name: str, total_bytes: int) -> tuple[list[tuple[str, object, str]], Optional[dict], Optional[Geometry]]:
    """Problems (composition, every rule, preflight incl. memory) and the memory estimate of one recipe."""
    try:
        cfg = _compose(name)
    except Exception as e:  # composition: unknown key, bad group option, bad enum value ...
        detail = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
        return [("(composition)", name, detail[:400])], None, None
    try:
        g = check(cfg)
        problems = []
    except ConfigError as e:
        problems, g = list(e.problems), None
        try:
            from pipeline import sources
            g = sources.geometry(cfg.model)
        except PipelineError:
            pass
    est = None
    if g is not None:
        problems += memory_problems(cfg, g, total_bytes)
        est = memory_estimate(cfg, g)
    return problems, est, g


def smoke(name: str, g: Geometry) -> Optional[str]:
    """Builds the recipe end to end on a tiny random model of the same architecture; None if it passed."""
    from pipeline.session import build
    tiny = TINY_FOR_ARCH.get(g.arch)
    if tiny is None:
        return f"no tiny model for architecture {g.arch!r}"
    # random weights: what quantization costs against float means nothing here, so only the program's
    # fidelity to the eager model of the same quantization (same_quant) is gated
    cfg = _compose(name, f"model={tiny}", "export.max_context_len=64", "export.prefill_chunk=8",
                   "verify.max_new_tokens=8", "verify.vs_float.min_greedy_match=null",
                   "verify.vs_float.max_logit_err=null", "verify.vs_float.min_top1=null",
                   "verify.vs_float.max_kld=null", "verify.vs_float.max_kld_ratio=null", "run.progress=false")
    try:
        m = build(cfg, recipe=f"{name} (smoke on {tiny})")
    except PipelineError as e:
        return str(e).splitlines()[0]
    return None if m["status"] == "ok" else f"status {m['status']}"


def main(argv=None) -> int:
    import argparse

    import psutil

    from pipeline.config import register_configs
    from pipeline.paths import RECIPES_DIR
    from pipeline.recipes import register_recipes

    ap = argparse.ArgumentParser(prog="python -m pipeline.validate",
                                 description="Check every recipe (composition, rules, preflight, memory) "
                                             "without downloading or building anything.")
    ap.add_argument("dir", nargs="?", default=str(RECIPES_DIR), help="recipe folder (default: recipes/)")
    ap.add_argument("--smoke", action="store_true",
                    help="also build each recipe end to end on a tiny random model of its architecture")
    a = ap.parse_args(argv)
    from pathlib import Path
    root = Path(a.dir).resolve()
    if not root.is_dir():
        print(f"error: {a.dir}: not a folder", flush=True)
        return 2
    register_configs()
    names = register_recipes(root)
    if not names:
        print(f"error: no *.yaml recipes under {root}")
        return 2
    total = psutil.virtual_memory().total
    rows, bad = [], 0
    for name in names:
        problems, est, g = validate_recipe(name, total)
        if a.smoke and not problems and g is not None:
            why = smoke(name, g)
            if why:
                problems.append(("(smoke)", name, why))
        bad += bool(problems)
        rows.append((name, problems, est))
    w = max(len(n) for n in names)
    print(f"{'recipe':<{w}}  {'status':<6}  {'export peak':>11}  {'KV cache':>9}  problems")
    for name, problems, est in rows:
        exp = f"{est['export_peak_bytes'] / 2**30:.1f} GiB" if est else "-"
        kv = f"{est['kv_cache_bytes'] / 2**20:.1f} MiB" if est else "-"
        first = True
        for key, value, why in problems or [("", "", "")]:
            head = f"{name:<{w}}  {'FAIL' if problems else 'ok':<6}  {exp:>11}  {kv:>9}" if first else " " * (w + 33)
            print(f"{head}  {f'{key}={value!r}: {why}' if key else ''}")
            first = False
    print(f"\n{len(rows)} recipe(s), {bad} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
