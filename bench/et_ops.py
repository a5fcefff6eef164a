"""The benchmark's yardstick for `cache=custom`: the same model with ExecuTorch's own LLM ops
(`llama::update_cache` + `llama::custom_sdpa` over an in-graph cache), run through the ExecuTorch
Python runtime (the only place those kernels exist in the wheel). Full attention only (SmolLM2).

    python bench/et_ops.py --model-dir DIR --out et_ops.pte [--quantize 8da4w]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.model.layers.attention import HookedAttentionLM, attention_layers  # noqa: E402

ATTN_IMPL = "et_llama_custom_sdpa"


def _et_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    # ExecuTorch's ops take [B, S, H, D]; the cache is [B, max_seq, Hkv, D]
    start = kwargs["position_ids"].reshape(-1)[0].item()
    torch._check_is_size(start)
    torch._check(start < module.k_cache.shape[1])
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    torch.ops.llama.update_cache(k, module.k_cache, start)
    torch.ops.llama.update_cache(v, module.v_cache, start)
    out = torch.ops.llama.custom_sdpa(q, module.k_cache, module.v_cache, start, None, 0.0, True,
                                      scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out, None


class EtOpsLM(HookedAttentionLM):
    def __init__(self, model: nn.Module, max_context_len: int):
        super().__init__(model, "last", ATTN_IMPL, _et_attention)
        cfg = model.config.get_text_config()
        if getattr(cfg, "sliding_window", None) and cfg.model_type != "llama":
            raise NotImplementedError("the ExecuTorch-ops baseline has full attention only")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        for m in attention_layers(model):
            shape = (1, max_context_len, cfg.num_key_value_heads, head_dim)
            m.register_buffer("k_cache", torch.zeros(shape), persistent=False)
            m.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, tokens, positions):
        return self._logits(tokens, positions)


def build(model_dir: Path, out: Path, quantize: str, context: int, chunk: int) -> None:
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (registers llama::)
    from omegaconf import OmegaConf

    from pipeline.exporters.native import export_program, lower_program
    from pipeline.model.loading import load_hf_model
    from pipeline.config import QuantizeConfig
    from pipeline.model.quant.apply import quantize_module

    module = EtOpsLM(load_hf_model(model_dir), context).eval()
    if quantize != "none":
        q = OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "quantize" / f"{quantize}.yaml")
        q.pop("defaults", None)
        q = OmegaConf.merge(OmegaConf.structured(QuantizeConfig), q)
        with torch.no_grad():
            quantize_module(module, q)
    ep = export_program(module, chunk)
    cfg = OmegaConf.create({"backend": {"name": "xnnpack", "quant_fusion": True}})
    et, _ = lower_program(ep, cfg, {"get_max_seq_len": chunk, "get_max_context_len": context})
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(et.buffer)
    tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quantize", default="8da4w")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128)
    a = ap.parse_args()
    build(a.model_dir, a.out, a.quantize, a.context, a.chunk)


if __name__ == "__main__":
    main()
