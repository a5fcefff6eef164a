"""Preflight: every cross-field rule, checked before any download or build; all problems in one error.

Hydra rejects unknown group choices, bad Enum values and unknown keys set without `+`; keys added with `+`/`++`
reach the config, so `unknown_key_problems` refuses them here. What a
route, a backend or a cache mode cannot do is declared by its own module (pipeline/exporters, pipeline/backends,
pipeline/model/cache_modes); this module asks them. The memory estimate it checks is pipeline/memory_estimate.py's.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from typing import Optional

import psutil
from omegaconf import DictConfig, ListConfig

from pipeline.backends import BACKENDS
from pipeline.config import PipelineConfig, v
from pipeline.errors import ConfigError, PipelineError
from pipeline.exporters import EXPORTERS
from pipeline.memory_estimate import embedding_parameters, memory_estimate, parameter_count
from pipeline.ops import isa_problem
from pipeline.model import adapter, sources
from pipeline.model.cache_modes import CACHE_MODES, flags
from pipeline.model.geometry import Geometry
from pipeline.model.layers import key_calibration
from pipeline.model.archs import ROLES, UnsupportedArch
from pipeline.model.quant import resolve
from pipeline.store.backends import redacted, url_problem
from pipeline.paths import OUTPUTS_ROOT, is_inside_outputs

Problems = list[tuple[str, object, str]]


def check(cfg, geometry_fn=None, total_bytes: Optional[int] = None, notes: Optional[list] = None) -> Optional[Geometry]:
    """Raise ConfigError listing every problem; returns the model geometry when it could be read. A build that would
    not fit this machine's memory (total_bytes, default: all of it) is refused here, before any download. Defaults
    left to the model and the backend (null) are fitted in cfg first (`fit`); `notes` gets what was chosen."""
    problems = unknown_key_problems(cfg)
    if problems:  # the other rules read the schema's keys; report the strangers alone
        raise ConfigError(problems)
    # rules that need the model's geometry (read from config/GGUF header, never the weights)
    geometry, problems = None, []
    try:
        geometry = (geometry_fn or sources.geometry)(cfg.model)
    except UnsupportedArch as err:  # read from config.json (or the GGUF header) alone: no weights, no download
        problems.append((err.key, err.name, err.why))
    except PipelineError as err:
        problems.append((_source_key(cfg.model), _source_value(cfg.model), str(err).split(": ", 1)[-1]))
    chosen = fit(cfg, geometry)
    if notes is not None:
        notes += chosen
    problems += quantize_problems(cfg) + cache_problems(cfg) + export_problems(cfg) + verify_problems(cfg)
    problems += EXPORTERS[cfg.export.exporter].problems(cfg)
    if not is_inside_outputs(cfg.run.output_dir):
        problems.append(("run.output_dir", cfg.run.output_dir, f"must be inside {OUTPUTS_ROOT}"))
    if cfg.run.store_url and url_problem(cfg.run.store_url):
        problems.append(("run.store_url", redacted(cfg.run.store_url), url_problem(cfg.run.store_url)))
    if isa_problem():  # verify runs our kernels on the path it names
        problems.append(("LLMPIPE_ISA (environment)", os.environ["LLMPIPE_ISA"], isa_problem()))
    if geometry is not None:
        problems += arch_problems(cfg, geometry) + geometry_problems(cfg, geometry) + adapter_problems(cfg, geometry)
        problems += EXPORTERS[cfg.export.exporter].geometry_problems(cfg, geometry)
        problems += memory_problems(cfg, geometry, total_bytes or psutil.virtual_memory().total)
    if problems:
        raise ConfigError(problems)
    return geometry


def adapter_problems(cfg, g: Geometry) -> Problems:
    """model.adapter: a PEFT LoRA folder whose targets are linears of this model (its adapter_config.json only)."""
    path = cfg.model.adapter
    if not path:
        return []
    why = adapter.problem(path, list(g.linear_shapes()))
    if why:
        return [("model.adapter", path, why)]
    if adapter.separate(cfg):
        return separate_adapter_problems(cfg, g)
    if cfg.quantize.source_grid:
        return [("quantize.source_grid", True, "carries the GGUF file's blocks of the base weights: the adapter "
                 "(model.adapter) changes them, so choose one of the two")]
    return []


def separate_adapter_problems(cfg, g: Geometry) -> Problems:
    """model.adapter_mode=separate: the adapter's branches each beside a plain linear of the base, whose weights the
    pipeline leaves as it quantized them."""
    path, key = cfg.model.adapter, "model.adapter_mode"
    why = adapter.separate_problem(path)
    if why:
        return [("model.adapter", path, why)]
    out = []
    linears = set(g.linear_shapes())
    adapted = sorted({adapter.module_name(n) for n in adapter.weight_names(path) if n.endswith(".lora_A.weight")})
    strangers = [n for n in adapted if n not in linears]
    if strangers:
        out.append(("model.adapter", path, f"adapts {strangers[:4]}{' ...' if len(strangers) > 4 else ''}, not "
                    "plain linears of this model (an expert's weights are not): model.adapter_mode=merge"))
    why = BACKENDS[cfg.backend.name].ADAPTER_APART_WHY
    if why:
        out.append((key, "separate", f"backend={v(cfg.backend.name)}: {why}"))
    return out


DEFAULT_CHUNK = 128  # export.prefill_chunk when null, where the model allows it


def fit(cfg, g: Optional[Geometry]) -> list[str]:
    """Fill in the defaults left null for the model and the backend to decide, in place; returns what was chosen:
    export.prefill_chunk, the largest chunk up to DEFAULT_CHUNK the model allows (the context, the smallest sliding
    window: a ring holds window + chunk - 1 slots); verify.native, whether the C++ runner runs this backend's and
    route's programs."""
    chosen = []
    e, vc = cfg.export, cfg.verify
    if e.prefill_chunk is None:
        window = g.smallest_window if g is not None else None
        e.prefill_chunk = min(DEFAULT_CHUNK, max(1, e.max_context_len), window or DEFAULT_CHUNK)
        why = f"smallest sliding window {window}" if window and e.prefill_chunk == window else \
            f"export.max_context_len {e.max_context_len}" if e.prefill_chunk == e.max_context_len < DEFAULT_CHUNK \
            else "the default"
        chosen.append(f"export.prefill_chunk={e.prefill_chunk} (null: the largest chunk up to {DEFAULT_CHUNK} this "
                      f"model allows; here {why})")
    if vc.native is None:
        backend, route = BACKENDS[cfg.backend.name], EXPORTERS[cfg.export.exporter]
        vc.native = bool(backend.NATIVE_RUNNER and route.NATIVE_RUNNER)
        if not vc.native:
            chosen.append(f"verify.native=false (null: the C++ runner does not run backend={v(cfg.backend.name)} "
                          f"programs of export.exporter={v(cfg.export.exporter)}; verify runs them in the "
                          f"{backend.RUNTIME} runtime)")
    return chosen


def unknown_key_problems(cfg, schema=PipelineConfig, prefix: str = "") -> Problems:
    """Keys the schema does not have (`+key=1`, `++model.x=1`, an extra key in a recipe): nothing would read them."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    problems: Problems = []
    for key in cfg.keys() if isinstance(cfg, DictConfig) else ():
        where = f"{prefix}{key}"
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            problems.append((where, cfg._get_node(key)._value(), f"unknown key (allowed here: {allowed})"))
            continue
        sub, node = _dataclass_in(hints[key]), cfg._get_node(key)
        if sub is not None and isinstance(node, DictConfig):
            problems += unknown_key_problems(node, sub, f"{where}.")
        elif sub is not None and isinstance(node, ListConfig):  # e.g. quantize.overrides
            for i, item in enumerate(node):
                problems += unknown_key_problems(item, sub, f"{where}[{i}].")
    return problems


def _dataclass_in(hint):
    """The dataclass a field holds (directly, Optional, or as List items); None for plain values."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def quantize_problems(cfg) -> Problems:
    q, backend = cfg.quantize, v(cfg.backend.name)
    out = []
    for key, group_key, (scheme, group) in ((k, gk, c.pair) for k, gk, c in resolve.knobs(q)):
        if scheme == "none":
            continue
        why = BACKENDS[backend].refuses(scheme, group, v(cfg.export.dtype), gemm=key != "quantize.embedding")
        if why:
            out.append((key, scheme, f"backend={backend} refuses it at export.dtype={v(cfg.export.dtype)}: {why}"))
        if scheme == "nvfp4" and group != 16:
            out.append((group_key, group, "nvfp4 uses group size 16"))
        if scheme == "nvfp4" and v(q.algorithm) != "minmax":
            out.append(("quantize.algorithm", v(q.algorithm), "nvfp4 has its own scales: allowed ['minmax']"))
        if group < 0:
            out.append((group_key, group, "must be >= 0 (0 = per channel)"))
    if q.source_grid and v(cfg.model.source) != "gguf":
        out.append(("quantize.source_grid", True, f"carries a GGUF file's own blocks: needs model.source=gguf "
                    f"(is {v(cfg.model.source)!r})"))
    if q.smoothing is not None:
        if not 0 < q.smoothing < 1:
            out.append(("quantize.smoothing", q.smoothing, "SmoothQuant's alpha: allowed 0 < alpha < 1, or null (off)"))
        if q.source_grid:
            out.append(("quantize.smoothing", q.smoothing, "the source's grid holds the unsmoothed weights: "
                        "quantize.source_grid=true carries them, so choose one of the two"))
        if not any(key != "quantize.embedding" and c.scheme != "none" for key, _, c in resolve.knobs(q)):
            out.append(("quantize.smoothing", q.smoothing, "smooths the inputs of quantized linears: none are "
                        "quantized (quantize.linear / lm_head / overrides)"))
    if v(q.algorithm) == "gptq" and q.source_grid:
        out.append(("quantize.algorithm", "gptq", "rounds the weights anew: quantize.source_grid=true carries the "
                    "file's own rounding, so choose one of the two"))
    if q.target_bpw is not None:
        planning = [name for name, b in BACKENDS.items() if b.PLAN_CANDIDATES]
        if not BACKENDS[backend].PLAN_CANDIDATES:
            out.append(("quantize.target_bpw", q.target_bpw, f"backend={backend} has no schemes to allocate: "
                        f"allowed on {sorted(planning)}"))
        elif not 2 <= q.target_bpw <= 32:
            out.append(("quantize.target_bpw", q.target_bpw, "file bits per weight: allowed 2 to 32, or null (off)"))
        else:
            for scheme, group in BACKENDS[backend].PLAN_CANDIDATES:
                why = BACKENDS[backend].refuses(scheme, group, v(cfg.export.dtype))
                if why:
                    out.append(("quantize.target_bpw", q.target_bpw, f"allocates {scheme} g{group}, which "
                                f"backend={backend} refuses at export.dtype={v(cfg.export.dtype)}: {why}"))
    return out


def cache_problems(cfg) -> Problems:
    """cache.custom_sdpa / cache.custom_kv_cache take a combination the mode declares (its FLAGS), and the backend
    builds that combination."""
    mode = v(cfg.cache.mode)
    allowed = CACHE_MODES[mode].FLAGS
    got = flags(cfg.cache)
    if got not in allowed:
        return [("cache.custom_sdpa/custom_kv_cache", [got["custom_sdpa"], got["custom_kv_cache"]],
                 f"cache.mode={mode} takes [custom_sdpa, custom_kv_cache] in "
                 f"{[[f['custom_sdpa'], f['custom_kv_cache']] for f in allowed]} ({CACHE_MODES[mode].FLAGS_WHY})")]
    why = BACKENDS[cfg.backend.name].refuses_cache(mode, got)
    if why:
        return [("cache.mode", mode, f"backend={v(cfg.backend.name)} refuses it (cache.custom_sdpa="
                 f"{got['custom_sdpa']}, custom_kv_cache={got['custom_kv_cache']}): {why}")]
    kv_dtype = cfg.cache.kv_dtype
    if kv_dtype is not None:
        why = CACHE_MODES[mode].kv_dtype_refused(got) or BACKENDS[cfg.backend.name].refuses_kv_dtype()
        if why:
            return [("cache.kv_dtype", v(kv_dtype), f"cache.mode={mode}, backend={v(cfg.backend.name)}: {why}")]
    if cfg.cache.calibrate_keys:
        m = CACHE_MODES[mode]
        why = key_calibration.unsupported(m.RUNTIME_OWNED or m.kv_dtype_refused(got) is None,
                                          "int4" in BACKENDS[cfg.backend.name].KV_STORAGES)
        if why:
            return [("cache.calibrate_keys", True, f"cache.mode={mode}, backend={v(cfg.backend.name)}: {why}")]
    return []


def export_problems(cfg) -> Problems:
    e = cfg.export
    out = []
    mode = CACHE_MODES[cfg.cache.mode]
    if v(e.fault) == "ring_one_short" and not (mode.rings(flags(cfg.cache)) and not mode.RUNTIME_OWNED):
        out.append(("export.fault", "ring_one_short", f"needs rings in the program: cache.mode=custom with both "
                    f"custom_sdpa and custom_kv_cache (is {v(cfg.cache.mode)!r}, {flags(cfg.cache)})"))
    if v(e.logits_mode) not in (*mode.LOGITS_MODES, "auto"):
        out.append(("export.logits_mode", v(e.logits_mode), f"cache.mode={v(cfg.cache.mode)} allowed: "
                    f"{list(mode.LOGITS_MODES)}"))
    elif v(e.logits_mode) == "tail" and not BACKENDS[cfg.backend.name].TAIL_LOGITS:
        out.append(("export.logits_mode", "tail", f"backend={v(cfg.backend.name)} cannot lower it: selected or auto"))
    if e.tail_rows < 1:
        out.append(("export.tail_rows", e.tail_rows, "must be >= 1 (logits mode tail's most rows)"))
    if e.max_context_len < 2:
        out.append(("export.max_context_len", e.max_context_len, "must be >= 2"))
    if e.prefill_chunk < 1:
        out.append(("export.prefill_chunk", e.prefill_chunk, "must be >= 1"))
    elif e.prefill_chunk > e.max_context_len:
        out.append(("export.prefill_chunk", e.prefill_chunk, f"must be in [1, export.max_context_len={e.max_context_len}]"))
    return out


def verify_problems(cfg) -> Problems:
    vc, e, mode, backend = cfg.verify, cfg.export, v(cfg.cache.mode), v(cfg.backend.name)
    out = []
    if vc.max_new_tokens < 1:
        out.append(("verify.max_new_tokens", vc.max_new_tokens, "must be >= 1"))
    if vc.enabled and not list(vc.prompts) and not vc.long_prompt:
        out.append(("verify.prompts", [], "needs at least one prompt (or verify.long_prompt) when verify.enabled=true"))
    if vc.long_prompt and e.max_context_len - vc.max_new_tokens < 2:
        out.append(("verify.max_new_tokens", vc.max_new_tokens, f"leaves no room for the long prompt in "
                    f"export.max_context_len={e.max_context_len}"))
    if vc.enabled and vc.native and not BACKENDS[backend].NATIVE_RUNNER:
        out.append(("verify.native", vc.native, f"the C++ runner here cannot run backend={backend} programs: set "
                    f"verify.native=false (verify runs them in the {BACKENDS[backend].RUNTIME} runtime)"))
    runtime_owned = CACHE_MODES[mode].RUNTIME_OWNED
    if vc.batched and (not runtime_owned or not vc.native):
        out.append(("verify.batched", vc.batched, f"the batched check runs llm_batched_runner on an off-graph program "
                    f"against the single-session C++ runs: needs cache.mode=offgraph (is {mode!r}) and verify.native=true"))
    rt = vc.runtime
    changed = [k for k, default in (("kv_max_capacity", None), ("kv_initial_capacity", 512), ("kv_windows", None),
                                    ("kv_storage_dtype", None)) if rt[k] != default]
    if changed and not runtime_owned:
        out.append(("verify.runtime." + changed[0], v(rt[changed[0]]), f"runtime cache parameters need cache.mode="
                    f"offgraph (cache.mode={mode!r} keeps its cache in the program)"))
    storages = BACKENDS[backend].KV_STORAGES
    if rt.kv_storage_dtype is not None and v(rt.kv_storage_dtype) not in storages:
        out.append(("verify.runtime.kv_storage_dtype", v(rt.kv_storage_dtype), f"backend={backend} allowed: "
                    f"{list(storages)} ({BACKENDS[backend].KV_STORAGES_WHY})"))
    if rt.kv_max_capacity is not None and not 1 <= rt.kv_max_capacity <= e.max_context_len:
        out.append(("verify.runtime.kv_max_capacity", rt.kv_max_capacity,
                    f"must be in [1, export.max_context_len={e.max_context_len}] (null = the max context)"))
    if rt.kv_initial_capacity < 1:
        out.append(("verify.runtime.kv_initial_capacity", rt.kv_initial_capacity, "must be >= 1"))
    if rt.kv_windows is not None and (not list(rt.kv_windows) or any(w < 0 for w in rt.kv_windows)):
        out.append(("verify.runtime.kv_windows", list(rt.kv_windows),
                    "a non-empty list of windows >= 0 (0 = flat), repeated over the caches"))
    return out


def geometry_problems(cfg, g: Geometry) -> Problems:
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
    if q.lm_head is not None and v(q.lm_head) != "none" and q.lm_head_group_size > 0 \
            and g.hidden_size % q.lm_head_group_size:
        out.append(("quantize.lm_head_group_size", q.lm_head_group_size, f"must divide the lm_head's in_features "
                    f"{g.hidden_size}; divisors that work: {_common_divisors([g.hidden_size])}"))
    from pipeline.model.quant.allocate import target_problems
    out += override_problems(q, g) + target_problems(q, g, parameter_count(g), embedding_parameters(g),
                                                     BACKENDS[cfg.backend.name])
    if v(q.embedding) != "none" and q.embedding_group_size > 0 and g.hidden_size % q.embedding_group_size:
        out.append(("quantize.embedding_group_size", q.embedding_group_size,
                    f"must divide the embedding dim {g.hidden_size}; divisors that work: "
                    f"{_common_divisors([g.hidden_size])}"))
    if g.rotary_switch and e.max_context_len > g.rotary_switch:
        out.append(("export.max_context_len", e.max_context_len, f"must be <= {g.rotary_switch}, the model's longrope "
                    "original_max_position_embeddings: past it HF rotates every position with the long factors, which "
                    "a cache built position by position cannot follow"))
    if g.max_position_embeddings and e.max_context_len > g.max_position_embeddings:
        out.append(("export.max_context_len", e.max_context_len,
                    f"exceeds the model's max_position_embeddings {g.max_position_embeddings}"))
    return out


def override_problems(q, g: Geometry) -> Problems:
    """Each quantize.overrides entry names linears by a pattern or a role (exactly one), matches at least one of
    this architecture's linears, and its group size divides their in_features."""
    specs = g.linear_specs()
    out = []
    for i, o in enumerate(q.overrides):
        key = f"quantize.overrides[{i}]"
        if (o.pattern is None) == (o.role is None):
            out.append((f"{key}.pattern/role", [o.pattern, v(o.role)], "set exactly one: a name pattern "
                        "('*.mlp.down_proj') or a role (" + ", ".join(ROLES) + ")"))
            continue
        matched = {name: n for name, (_, n, role) in specs.items() if resolve.override_matches(o, name, role)}
        if not matched and o.pattern is not None:
            out.append((f"{key}.pattern", o.pattern, f"matches no linear of this {g.arch} model; they are named like "
                        + ", ".join(repr(n) for n in list(specs)[:4]) + ", 'lm_head'"))
        elif not matched:
            roles = sorted({role for _, _, role in specs.values()})
            out.append((f"{key}.role", v(o.role), f"this {g.arch} model has no linear of that role; its roles: {roles}"))
        elif o.group_size > 0 and any(n % o.group_size for n in matched.values()):
            out.append((f"{key}.group_size", o.group_size, f"must divide the in_features of the "
                        f"linears it matches ({sorted(set(matched.values()))}); divisors that work: "
                        f"{_common_divisors(matched.values())}"))
    return out


def arch_problems(cfg, g: Geometry) -> Problems:
    """What the model's config asks that its architecture's entry does not build (pipeline/model/archs), and what
    the backend, the cache mode or the dtype cannot build of this architecture."""
    out = [(f"config.json {key}", value, f"{g.arch}: {why}") for key, value, why in g.problems]
    arch, name = g.entry, f"{g.arch} ({g.entry.family})"
    why = BACKENDS[cfg.backend.name].refuses_arch(arch)
    if why:
        out.append(("backend.name", v(cfg.backend.name), f"cannot build {name}: {why}"))
    why = CACHE_MODES[cfg.cache.mode].refuses_arch(arch, flags(cfg.cache))
    if why:
        out.append(("cache.mode", v(cfg.cache.mode), f"cannot build {name}: {why}"))
    if cfg.cache.calibrate_keys and key_calibration.refused(arch):
        out.append(("cache.calibrate_keys", True, f"{name}: {key_calibration.refused(arch)}"))
    if arch.experts is not None and v(cfg.export.dtype) != "fp32":
        out.append(("export.dtype", v(cfg.export.dtype), f"{name}: the experts' kernel (llmpipe::experts) computes "
                    "in fp32: allowed ['fp32']"))
    if g.recurrent and v(cfg.export.dtype) != "fp32":
        out.append(("export.dtype", v(cfg.export.dtype), f"{name}: the recurrent layers' kernels "
                    "(llmpipe::causal_conv, gated_delta_rule) take fp32 activations: allowed ['fp32']"))
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


def memory_problems(cfg, g: Geometry, total_bytes: int) -> Problems:
    est = memory_estimate(cfg, g)
    out = []
    if est["peak_bytes"] > total_bytes:
        stage = max(est["stage_peak_bytes"], key=est["stage_peak_bytes"].get)
        out.append(("model", cfg.model.name, f"the {stage} stage needs about {est['peak_bytes'] / 2**30:.1f} GiB, "
                                              f"this machine has {total_bytes / 2**30:.1f} GiB"))
    if est["kv_cache_bytes"] > total_bytes / 4:
        out.append(("export.max_context_len", cfg.export.max_context_len,
                    f"the KV cache alone needs {est['kv_cache_bytes'] / 2**30:.2f} GiB (a quarter of this "
                    f"machine's {total_bytes / 2**30:.1f} GiB is the limit)"))
    return out
