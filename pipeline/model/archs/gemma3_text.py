"""Gemma 3 (text): sandwich norms that scale by (1 + weight), per-head q/k norms, five sliding layers to one full,
an embedding scaled by sqrt(hidden), local and global rotary bases."""
from pipeline.model.archs import Arch, Attention, Norms


def random_config(r, common: dict) -> dict:
    """A tiny Gemma 3: a full layer every `sliding_window_pattern` layers."""
    types = ["full_attention" if (i + 1) % r.sliding_window_pattern == 0 else "sliding_attention"
             for i in range(r.num_hidden_layers)]
    return dict(common, sliding_window=r.sliding_window or 16, layer_types=types, query_pre_attn_scalar=r.head_dim)


def gguf_layer_types(n: int, window) -> list[str]:
    """A Gemma 3 GGUF names a window, not the pattern: every 6th layer is global (sliding_window_pattern = 6)."""
    if not window:
        return ["full_attention"] * n
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


ARCH = Arch(family="Gemma 3", attention=Attention(qk_norm="head"),
            norms=Norms(placement="sandwich", mlp_input="pre_feedforward_layernorm", offset=1.0),
            rotary="rope (local and global bases)", embedding_scale="sqrt(hidden)", logits="final softcap (optional)",
            refuses=(("attn_logit_softcapping", bool, "attention logit softcapping: the cache modes' kernels do "
                      "not apply it"),),
            gguf_arch="gemma3", gguf_layer_types=gguf_layer_types, tiny_model="tiny_gemma3",
            random_config=random_config)
