"""LFM2-MoE: LFM2's short-convolution and attention layers (layer_types); the first num_dense_layers MLPs dense
(w1 / w3 / w2 at intermediate_size), the others a sigmoid router whose top-k is picked after a per-expert bias (a
buffer of the block), over stacked experts."""
from pipeline.model.archs import Arch, Attention, Experts, Mlp, Norms, ShortConv


def dense_layers(config) -> list[int]:
    return list(range(min(config.num_dense_layers, config.num_hidden_layers)))


def random_config(r, common: dict) -> dict:
    """A tiny LFM2-MoE: conv and attention layers alternating, conv first; the first layer dense, 8 experts (top 2)."""
    return dict(common, layer_types=["full_attention" if i % 2 else "conv" for i in range(r.num_hidden_layers)],
                conv_L_cache=3, num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


ARCH = Arch(family="LFM2-MoE", attention=Attention(o="out_proj", qk_norm="head"),
            mlp=Mlp(path="feed_forward", gate="w1", up="w3", down="w2"),
            norms=Norms(attention_input="operator_norm", mlp_input="ffn_norm"), short_conv=ShortConv(),
            experts=Experts(dense_layers=dense_layers), random_config=random_config)
