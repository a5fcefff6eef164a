"""Qwen3.5 (text; a checkpoint's config.json nests it as `text_config` of `qwen3_5`): three Gated DeltaNet layers
(linear attention over a recurrent state) to one full-attention layer whose output is gated per head; norms scale by
(1 + weight); q/k norms; partial rotary (Qwen3.5's multi-axis rotary is the plain one for text positions)."""
from pipeline.model.archs import Arch, Attention, GatedDeltaNet, Norms


def delta_layers(r, common: dict) -> dict:
    """A full-attention layer every fourth, the others Gated DeltaNet with heads like the attention's (a key head per
    two value heads) unless given (Qwen3.5 and Qwen3-Next)."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(r.num_hidden_layers)]
    linear_dim = r.linear_head_dim or r.head_dim
    return dict(common, layer_types=types, linear_num_key_heads=r.linear_num_key_heads or r.num_key_value_heads,
                linear_num_value_heads=r.linear_num_value_heads or r.num_attention_heads,
                linear_key_head_dim=linear_dim, linear_value_head_dim=linear_dim, linear_conv_kernel_dim=4)


def random_config(r, common: dict) -> dict:
    """A tiny Qwen3.5: delta_layers, a rotary of a quarter of the head dim (its multi-axis sections sum to half of
    that)."""
    rotary = r.head_dim // 4
    return dict(delta_layers(r, common),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [rotary // 2 - rotary // 4, rotary // 4, 0],
                                 "mrope_interleaved": True})


ARCH = Arch(family="Qwen3.5", attention=Attention(qk_norm="head", output_gate=True), norms=Norms(offset=1.0),
            gated_delta=GatedDeltaNet(), rotary="rope, partial (multi-axis: one axis for text)",
            random_config=random_config)
