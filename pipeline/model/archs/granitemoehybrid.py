"""Granite-4.0-H (granitemoehybrid): Mamba-2 layers and attention layers (layer_types), each followed by a mixture of
experts (block_sparse_moe, Granite MoE's) plus a shared MLP (shared_mlp: input_linear = gate | up, output_linear)
that the layer adds beside the block; Granite's multipliers. position_embedding_type "nope" (the released models):
attention without rotary, which HF's forward then skips."""
from pipeline.model.archs import Arch, Experts, Mamba2, Mlp, mamba_layer_kinds


def random_config(r, common: dict) -> dict:
    """A tiny Granite-4.0-H: Mamba-2 and attention layers alternating (8 Mamba heads of 16, a state of 16), 8 experts
    (top 2) and a shared MLP, rotary positions, Granite's multipliers."""
    return dict(common, layer_types=["full_attention" if i % 2 else "mamba" for i in range(r.num_hidden_layers)],
                mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8, num_local_experts=8,
                num_experts_per_tok=2, shared_intermediate_size=64, position_embedding_type="rope",
                embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0)


ARCH = Arch(family="Granite-4.0-H", mlp=Mlp(path="block_sparse_moe", gate_up="input_linear", down="output_linear"),
            experts=Experts(router="router", count_key="num_local_experts", width_key="intermediate_size",
                            shared="shared_mlp", shared_width_key="shared_intermediate_size", shared_in_layer=True),
            mamba2=Mamba2(), layer_kinds=mamba_layer_kinds, embedding_scale="embedding_multiplier",
            logits="logits_scaling", rotary="rope, or none (position_embedding_type nope)",
            refuses=(("num_local_experts", lambda n: not n,
                      "a dense Granite-4.0-H (no experts: its shared_mlp is the whole MLP) is not built yet; "
                      "allowed: num_local_experts >= 1"),),
            random_config=random_config)
