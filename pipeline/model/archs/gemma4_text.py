"""Gemma 4 (text): Gemma 3's norm placement (its norms scale by the weight itself, not 1 + w) plus value norms,
global layers with their own head dim and KV heads (values = keys with attention_k_eq_v), KV-shared trailing layers,
per-layer input embeddings, double-wide MLPs on shared layers."""
from pipeline.model.archs import Arch, Attention, Norms, PerLayer


def random_config(r, common: dict) -> dict:
    """A tiny Gemma 4: sliding layers with a full one every `sliding_window_pattern` (and last); global layers with
    their own head dim / KV heads and proportional partial RoPE (HF's defaults); per-layer inputs."""
    n, every = r.num_hidden_layers, r.sliding_window_pattern
    types = ["full_attention" if (i + 1) % every == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    cfg = dict(common, sliding_window=r.sliding_window or 16, layer_types=types,
               global_head_dim=r.global_head_dim or r.head_dim,
               hidden_size_per_layer_input=r.hidden_size_per_layer_input, vocab_size_per_layer_input=r.vocab_size,
               num_kv_shared_layers=r.num_kv_shared_layers, attention_k_eq_v=r.attention_k_eq_v,
               use_double_wide_mlp=r.use_double_wide_mlp)
    if r.num_global_key_value_heads:
        cfg["num_global_key_value_heads"] = r.num_global_key_value_heads
    return cfg


ARCH = Arch(family="Gemma 4", attention=Attention(qk_norm="head", v_norm=True),
            norms=Norms(placement="sandwich", mlp_input="pre_feedforward_layernorm"),  # scale by weight, not 1 + w
            per_layer=PerLayer(), rotary="rope; proportional partial rope on global layers",
            embedding_scale="sqrt(hidden)", logits="final softcap",
            refuses=(("enable_moe_block", bool, "Gemma 4's mixture-of-experts block is not built yet"),),
            tiny_model="tiny_gemma4", random_config=random_config)
