"""Calibrated keys (cache.calibrate_keys): what a cache stores of each key is (k - m) * a, and each query is fed to
attention as q / a, with m a layer's mean key per KV head (after RoPE and any key norm) and a a scale per channel,
both measured on the calibration corpus at wrap time.

The scores a query sees are q . (k - m): every score of the query moved by the same q . m, so the softmax weights
are those of q . k (a model with sink logits would need its sink moved too: refused). What changes is what an int4
row holds, after its rotation spreads every channel over the row:
- m: keys carry a large offset common to every position, in RoPE's slowest channels (Gemma 3's global layers: a mean
  key of norm ~100), which would set every group's scale;
- a: the rounding error is then about even over the rotated row, and a channel's share of a score's error is its
  query's energy Q times its own error. Scaling key channels by a (and queries by 1 / a) weighs the error by
  E[q_c^2] / a_c^2 against a row variance of sum a_c^2 Var[k_c]; the product is least at a_c^2 = sqrt(Q_c / Var[k_c])
  (Cauchy-Schwarz), normalized to an RMS of 1 and rounded to a power of two. Channels the queries barely read get
  coarse values, those they read with large weights fine ones.
Measured (bench/kv_quant.py, +KLD of int4 K/V over fp16 at depth 2048, six held-out domains): Gemma 3 +0.120
rotated alone, +0.068 with m, +0.024 with m and a; SmolLM2 +0.062, +0.047, +0.033.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from pipeline.model.layers.attention import attention_layers, kv_source

MEASURE_IMPL = "llmpipe_key_statistics"
TOKENS_PER_DOMAIN = 512  # the calibration corpus's first 512 tokens of each domain, one sequence each
# a channel's scale within [1/8, 8] of the row's RMS (a^4 spans a ratio of 4096 in E[q^2] / Var[k]): a channel of
# next to no variance in the calibration text does not take the row's range where a user's text moves it
SCALE_RANGE = 8.0


def refused(arch) -> str | None:
    """Why an architecture's keys cannot be calibrated, or None."""
    if arch.attention.sinks:
        return "its sink logits would need moving by q . mean for every query: not built"
    return None


def unsupported(fused_op: bool, int4_storage: bool) -> str | None:
    """Why a build cannot calibrate its keys (fused_op: its cache mode writes K/V through our fused ops, the in-graph
    one or the runtime-owned one; int4_storage: its backend's caches store int4 rows), or None."""
    if not fused_op:
        return ("our fused attention ops' callers transform the keys: cache.mode=custom with both custom flags, or "
                "offgraph")
    if not int4_storage:
        return "this backend's caches keep K/V in a float type, where the transform buys nothing"
    return None


def wanted(asked: bool | None, fused_op: bool, runtime_owned: bool, kv_dtype: str | None, int4_storage: bool,
           arch) -> bool:
    """cache.calibrate_keys resolved: as asked, else on where K may be stored as int4 rows (a runtime-owned cache's
    storage is the runtime's choice)."""
    if asked is not None:
        return asked
    if refused(arch) or unsupported(fused_op, int4_storage):
        return False
    return runtime_owned or kv_dtype == "int4"


def keys_in(module: nn.Module, key: torch.Tensor) -> torch.Tensor:
    """What the cache stores of key [B, Hkv, T, D]: (key - m) * a, when the module has them."""
    mean = getattr(module, "k_mean", None)
    if mean is None:
        return key
    return (key - mean.to(key.dtype)) * module.k_mul.to(key.dtype)


def queries_in(module: nn.Module, query: torch.Tensor) -> torch.Tensor:
    """What attention takes of query [B, Hq, T, D]: query / a of the cache it reads, when it has one."""
    mul = getattr(module, "q_mul", None)
    return query if mul is None else query * mul.to(query.dtype)


@torch.no_grad()
def measure(model: nn.Module, sequences: list[list[int]], context: int | None = None) -> dict[nn.Module, dict]:
    """Per attention module, over HF's own uncached forward of `sequences` (fp64 sums): its keys' sum and sum of
    squares [Hkv, D], its queries' sum of squares per KV head's group [Hkv, D], the count, and the group size.

    RoPE turns a key by its position, so a mean key over positions 0..n is not the mean over a session's: the
    sequences are placed at positions spread over [0, context) (their position_ids start there), one after another."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    layers = attention_layers(model)
    sums: dict[int, dict] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        hq, hk = query.shape[1], key.shape[1]
        k, q = key[0].double(), query[0].double()
        s = sums.setdefault(id(module), {"k": 0.0, "k2": 0.0, "q2": 0.0, "n": 0, "group": hq // hk})
        s["k"] = s["k"] + k.sum(1)
        s["k2"] = s["k2"] + (k * k).sum(1)
        s["q2"] = s["q2"] + (q * q).sum(1).unflatten(0, (hk, hq // hk)).sum(1)
        s["n"] += key.shape[2]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(MEASURE_IMPL, record)
    with _attention(layers, MEASURE_IMPL):
        for i, ids in enumerate(sequences):
            start = (max(context - len(ids), 0) * i) // max(len(sequences) - 1, 1) if context else 0
            model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                  use_cache=False, logits_to_keep=1)
    return {m: sums[id(m)] for m in layers if id(m) in sums}


@contextlib.contextmanager
def _attention(layers: list[nn.Module], impl: str):
    configs = []
    for m in layers:
        if all(c is not m.config for c in configs):
            configs.append(m.config)
    saved = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = impl
    try:
        yield
    finally:
        for c, s in zip(configs, saved):
            c._attn_implementation = s


def transform(stats: dict, readers: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, a), fp32 [Hkv, D], of a cache's writer statistics and those of every layer reading it (itself included)."""
    n = stats["n"]
    mean = stats["k"] / n
    var = (stats["k2"] / n - mean * mean).clamp_min(0)
    q2 = sum(r["q2"] / r["n"] for r in readers)
    a = (q2 / var.clamp_min(1e-12)).clamp_min(1e-12) ** 0.25
    a = (a / a.pow(2).mean(-1, keepdim=True).sqrt()).clamp(1 / SCALE_RANGE, SCALE_RANGE)
    # a power of two: a and 1 / a exact in every float type, so q / a . (k - m) * a is q . (k - m) to the last bit
    return mean.float(), torch.exp2(torch.round(torch.log2(a))).float()


def install(stats: dict[nn.Module, dict], dtype: torch.dtype) -> None:
    """Buffers on the wrapped model's attention modules, in the activation dtype: a cache's writer gets k_mean and
    k_mul [Hkv, 1, D]; every module gets q_mul [Hq, 1, D], 1 / a of the cache it reads (a KV-shared layer: its
    source's). Shaped to broadcast over [B, H, T, D] as they are: no reshape op in the program."""
    owners: dict[nn.Module, list[nn.Module]] = {}
    for m in stats:
        owners.setdefault(kv_source(m), []).append(m)
    for owner, readers in owners.items():
        mean, a = transform(stats[owner], [stats[r] for r in readers])
        owner.register_buffer("k_mean", mean.unsqueeze(1).to(dtype), persistent=False)
        owner.register_buffer("k_mul", a.unsqueeze(1).to(dtype), persistent=False)
        for r in readers:
            q_mul = (1 / a).repeat_interleave(stats[r]["group"], 0).unsqueeze(1)
            r.register_buffer("q_mul", q_mul.to(dtype), persistent=False)
