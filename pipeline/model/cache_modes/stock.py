"""The `stock` KV-cache mode: the cache lives in the program and every operator is ExecuTorch's own, so the program
runs unchanged in any ExecuTorch app that carries ExecuTorch's LLM custom ops (its prebuilt Android and iOS
runtimes do; so does TextLLMRunner in Python after `pipeline.ops.load()`):

    llama::update_cache(value [1,T,Hkv,D], cache! [1,S,Hkv,D], start_pos) -> dummy   cache[:, pos:pos+T] = value
    llama::custom_sdpa(q [1,T,Hq,D], k_cache, v_cache, start_pos, attn_mask=None, dropout_p=0., is_causal=False,
                       scale=None) -> [1,T,Hq,D]

- One pair of flat buffers [1, context, Hkv, D] per attention layer, in the activation dtype (the op takes its caches
  in q's dtype): sliding layers keep the whole context too (no rings: a ring's slots are not positions, and
  custom_sdpa's causal rule reads keys [0, start_pos + i] by position).
- Full layers: custom_sdpa(is_causal=True, start_pos) reads keys [0, start_pos + T). Sliding layers: an additive fp32
  mask [T, S] built in the graph from the positions (0 where position - window < key <= position, -inf elsewhere);
  with a mask the op reads all S keys and ignores start_pos.
- start_pos is `positions[0].item()`, bounded for torch.export (start_pos + T <= S), computed once a forward.
- Our C++ runners cannot link ExecuTorch's compiled llama kernels (they need libtorch): native/'s llmpipe_llama_ops
  twins them (native/src/kernels/llama_twins.cpp). The eager reference is ExecuTorch's own kernels
  (torch.ops.llama.*), so verify's same-quantization reference computes what the program computes.
- What ExecuTorch's ops cannot build is refused (refuses_arch): attention sinks, recurrent layers, KV-shared layers.
  cache.mode=custom builds all of them. A mixture of experts exports its experts as plain linears over every row
  (experts.DenseExperts: E / top-k times the routed op's work per token), not as our llmpipe::experts.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

import torch
from torch import nn

from pipeline.model.layers.attention import HookedAttentionLM, attention_layers, step_args
from pipeline.model.kv.layout import cache_layout

FLAGS = ({"custom_sdpa": True, "custom_kv_cache": True},)
FLAGS_WHY = "ExecuTorch's two LLM ops together: llama::update_cache writes the cache, llama::custom_sdpa attends"
RUNTIME_OWNED = False     # the cache is in the program
KERNELS = ("llama",)      # ExecuTorch's LLM custom ops (pipeline/ops.py LIBRARIES["llama"])
EXECUTORCH_OPS_ONLY = True  # export adds none of ours (no llmpipe::tied_head, no llmpipe::experts)
LOGITS_MODES = ("full", "last", "tail", "selected")  # export.logits_mode values
ATTN_IMPL = "executorch_llama"
QUALNAMES = ("llama::update_cache", "llama::custom_sdpa")


def _ops():
    """ExecuTorch's LLM ops, registered by importing its custom_ops module (its AOT library of kernels)."""
    if not hasattr(torch.ops.llama, "custom_sdpa"):
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
    return torch.ops.llama


def takes_rows(flags: dict) -> bool:
    return True  # the module's forward takes rows (logits mode `selected`); auto picks `tail`: the cache is ours


def sdpa_with_kv_cache(flags: dict) -> bool:
    return True  # one custom op attends over the cache (ExecuTorch's runner metadata)


def exports_non_strict(flags: dict) -> bool:
    return True  # plain buffers and two registered ops: the same graph without dynamo


def rings(flags: dict) -> bool:
    return False  # custom_sdpa's causal rule is by position: every layer flat


def kv_dtype_refused(flags: dict) -> str | None:
    return "llama::custom_sdpa takes its caches in the query's dtype (export.dtype); cache.mode=custom stores half K/V"


def constant_methods(cfg, context: int, chunk: int, flags: dict) -> dict:
    return {}  # flat caches in the program: nothing for a runner to size


def refuses_arch(arch, flags: dict) -> str | None:
    """What ExecuTorch's LLM ops cannot build; our fused op (cache.mode=custom) builds each."""
    alt = "use cache.mode=custom (our llmpipe:: ops)"
    if arch.attention.sinks:
        return f"attention sinks: llama::custom_sdpa's softmax takes no sink logits; {alt}"
    if arch.recurrent_kinds():
        return (f"recurrent layers ({', '.join(arch.recurrent_kinds())}): our ops keep and step their state "
                f"(llmpipe::causal_conv, gated_delta_rule, ssd_scan), and this mode builds attention layers only; "
                f"{alt}")
    if arch.per_layer is not None:
        return (f"KV-shared layers ({arch.per_layer.kv_shared_key}): a shared layer attends over another layer's "
                f"cache without writing it, and this mode keeps one cache per layer; {alt}")
    return None


def window_mask(positions: torch.Tensor, slots: int, window: int) -> torch.Tensor:
    """custom_sdpa's additive mask [T, S] of a sliding layer: 0 where position - window < key <= position."""
    keys = torch.arange(slots, dtype=positions.dtype).unsqueeze(0)
    rows = positions.reshape(-1, 1)
    visible = (keys <= rows) & (keys > rows - window)
    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(visible, zero, torch.full((), float("-inf"), dtype=torch.float32)).contiguous()


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


_DEVNULL: list[int] = []


@contextlib.contextmanager
def quiet_fd2():
    """ExecuTorch's eager custom_sdpa logs "No temp allocator provided" to fd 2 at every call (its AOT wrapper gives
    the kernel no temp allocator, and the kernel falls back to the heap): a calibration would print thousands."""
    if _is_tracing():
        yield
        return
    if not _DEVNULL:
        _DEVNULL.append(os.open(os.devnull, os.O_WRONLY))
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(_DEVNULL[0], 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def start_position(positions: torch.Tensor, T: int, slots: int):
    """The step's first position as the ops' start_pos: an int in eager (checked: the kernels do not say why they
    fail), a bounded unbacked size while exporting (start_pos + T <= S, as ExecuTorch's own llama export bounds it)."""
    if not _is_tracing():
        pos = positions.reshape(-1).tolist()
        if len(pos) != T or pos != list(range(pos[0], pos[0] + T)) or pos[0] < 0:
            raise ValueError(f"cache.mode=stock: positions must be {T} consecutive entries >= 0, got {pos}")
        if pos[0] + T > slots:
            raise ValueError(f"cache.mode=stock: positions [{pos[0]}, {pos[0] + T}) exceed the cache's {slots} "
                             "positions (the max context)")
        return pos[0]
    start = positions[0].item()
    torch._check(start >= 0)
    torch._check(start < slots)
    torch._check(start + T <= slots)
    return start


def _stock_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function: q/k arrive RoPE-rotated, [B,H,T,D]; returns ([B,T,H,D], None)."""
    _, scaling = step_args("stock", query, scaling, kwargs)
    step = module.__dict__.get("_stock_step")
    if step is None:
        raise RuntimeError("stock attention: called outside StockCacheLM's forward (no start position)")
    start, masks = step
    ops = _ops()
    # the ops take sequence-major [B,T,H,D], contiguous (their kernels check the dim order, not strides)
    ops.update_cache(key.transpose(1, 2).contiguous(), module.k_cache, start)
    ops.update_cache(value.transpose(1, 2).contiguous(), module.v_cache, start)
    q = query.transpose(1, 2).contiguous()
    with quiet_fd2():
        if module.kv_window > 0:
            out = ops.custom_sdpa(q, module.k_cache, module.v_cache, 0, masks[module.kv_window], 0.0, False, scaling)
        else:
            out = ops.custom_sdpa(q, module.k_cache, module.v_cache, start, None, 0.0, True, scaling)
    return out, None


class StockCacheLM(HookedAttentionLM):
    """Runner layout over an HF causal LM whose attention layers each write their flat cache with
    llama::update_cache and attend with llama::custom_sdpa (ExecuTorch's LLM ops)."""

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last"):
        _ops()
        super().__init__(model, logits_mode, ATTN_IMPL, _stock_attention)
        layout = cache_layout(model.config.get_text_config())
        dtype = next(model.parameters()).dtype
        self.context = int(max_context_len)
        for m in attention_layers(model):
            if layout.is_readonly(m.layer_idx):
                raise ValueError("cache.mode=stock: KV-shared layers are refused (cache.mode=custom builds them)")
            spec = layout.specs[layout.layer_cache[m.layer_idx]]
            if spec.v_dim != spec.head_dim:
                raise ValueError(f"cache.mode=stock: llama::custom_sdpa needs values as wide as keys, layer "
                                 f"{m.layer_idx} has {spec.v_dim} and {spec.head_dim}")
            m.kv_window = int(spec.window)
            shape = (1, max_context_len, spec.kv_heads, spec.head_dim)
            m.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
            m.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        layers = attention_layers(self.model)
        start = start_position(positions, tokens.shape[1], self.context)
        masks = {w: window_mask(positions, self.context, w) for w in {m.kv_window for m in layers if m.kv_window}}
        for m in layers:  # the step's start and masks, one of each per forward, for the attention calls
            m.__dict__["_stock_step"] = (start, masks)
        try:
            return self._logits(tokens, positions, rows)
        finally:
            for m in layers:
                m.__dict__.pop("_stock_step", None)

    def cache_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n.endswith(("k_cache", "v_cache")))

    def reset(self) -> None:
        for n, b in self.named_buffers():
            if n.endswith(("k_cache", "v_cache")):
                b.zero_()


def wrap(model: nn.Module, context: int, logits_mode: str, chunk: int, flags: dict, kv_dtype=None) -> nn.Module:
    return StockCacheLM(model, context, logits_mode)
