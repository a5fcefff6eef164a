"""LFM2: short-convolution blocks (a gated depthwise causal conv over a few tokens) between attention layers; the
attention's output projection is `out_proj` and its q/k norms are `q_layernorm` / `k_layernorm`; the MLP is w1 / w3 /
w2 at a width derived from intermediate_size; the final norm is `model.embedding_norm`."""
from pipeline.model.archs import Arch, Attention, Mlp, Norms, ShortConv


def mlp_width(config) -> int:
    """HF's Lfm2MLP: two thirds of intermediate_size, times the multiplier, rounded up to block_multiple_of."""
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * ((width + config.block_multiple_of - 1) // config.block_multiple_of)
    return width


def random_config(r, common: dict) -> dict:
    """A tiny LFM2: conv and attention layers alternating, conv first; the MLP at intermediate_size (no rounding)."""
    return dict(common, full_attn_idxs=[i for i in range(r.num_hidden_layers) if i % 2 == 1], conv_L_cache=3,
                block_auto_adjust_ff_dim=False)


ARCH = Arch(family="LFM2", attention=Attention(o="out_proj", qk_norm="head"),
            mlp=Mlp(path="feed_forward", gate="w1", up="w3", down="w2", width=mlp_width),
            norms=Norms(attention_input="operator_norm", mlp_input="ffn_norm"),
            short_conv=ShortConv(), random_config=random_config)
