"""Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side on the same normed input and sums them
(`hybrid` layers: a K/V cache and a recurrent state each), then an MLP; muP multipliers throughout (the embedding,
the attention's input, keys and output, the mixer's input, projection groups (mup_vector) and output, the MLP's
gate and down, the head), which HF's forward applies; the mixer's gated norm only with mamba_rms_norm, else
y * silu(z)."""
from pipeline.model.archs import Arch, Mamba2, Mlp, Norms


def random_config(r, common: dict) -> dict:
    """A tiny Falcon-H1: 8 Mamba heads of 16 over two B/C groups, a state of 16, and every multiplier away from 1."""
    return dict(common, mamba_d_ssm=2 * r.hidden_size, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
                mamba_chunk_size=8, embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.7,
                attention_in_multiplier=0.8, attention_out_multiplier=1.3, ssm_in_multiplier=1.2,
                ssm_out_multiplier=0.6, ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7], mlp_multipliers=[1.1, 0.9])


ARCH = Arch(family="Falcon-H1", mlp=Mlp(path="feed_forward"), norms=Norms(mlp_input="pre_ff_layernorm"),
            mamba2=Mamba2(parallel=True), embedding_scale="embedding_multiplier", logits="lm_head_multiplier",
            random_config=random_config)
