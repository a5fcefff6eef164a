"""Bamba (IBM): Mamba-2 layers with attention layers among them (config.attn_layer_indices), each followed by a
plain MLP (feed_forward) behind its own norm (pre_ff_layernorm)."""
from pipeline.model.archs import Arch, Mamba2, Mlp, Norms, mamba_layer_kinds


def random_config(r, common: dict) -> dict:
    """A tiny Bamba: the last of every two layers attention, the others Mamba-2 (8 heads of 16 over two B/C groups,
    a state of 16)."""
    return dict(common, attn_layer_indices=[i for i in range(r.num_hidden_layers) if i % 2 == 1], mamba_n_heads=8,
                mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8)


ARCH = Arch(family="Bamba", mlp=Mlp(path="feed_forward"), norms=Norms(mlp_input="pre_ff_layernorm"),
            mamba2=Mamba2(), layer_kinds=mamba_layer_kinds, random_config=random_config)
