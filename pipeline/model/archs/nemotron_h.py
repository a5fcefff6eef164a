"""Nemotron-H: a stack of single blocks behind one norm each (`mixer`): Mamba-2 (`M`), attention without rotary
(`*`), an ungated ReLU^2 MLP (`-`), or a mixture of experts (`E`); config.json's hybrid_override_pattern spells the
stack, which HF reads into layer_types. The Mamba-2 time step has a floor (time_step_min)."""
from pipeline.model.archs import Arch, Attention, Mamba2, Mlp, Norms, mamba_layer_kinds


def random_config(r, common: dict) -> dict:
    """A tiny Nemotron-H: Mamba-2, MLP, attention, MLP blocks (8 Mamba heads of 16 over two B/C groups, a state of
    16), its head untied (as the released models)."""
    pattern = ("M-*-" * r.num_hidden_layers)[:r.num_hidden_layers]
    return dict(common, hybrid_override_pattern=pattern, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                ssm_state_size=16, chunk_size=8, time_step_min=0.01, tie_word_embeddings=False)


ARCH = Arch(family="Nemotron-H", attention=Attention(path="mixer"), mlp=Mlp(path="mixer", gate=None),
            norms=Norms(attention_input="norm", mlp_input="norm"),
            mamba2=Mamba2(path="mixer", heads_key="mamba_num_heads", head_dim_key="mamba_head_dim",
                          groups_key="n_groups", state_key="ssm_state_size", kernel_key="conv_kernel",
                          activation_key="mamba_hidden_act"),
            layers="model.layers", layer_kinds=mamba_layer_kinds, blocks=True, rotary="none (NoPE)",
            refuses=(("layers_block_type", lambda types: "moe" in (types or ()),
                      "mixture-of-experts blocks (`E`: ungated ReLU^2 experts, a grouped sigmoid router) are not "
                      "built yet; allowed block kinds: mamba (M), attention (*), mlp (-)"),
                     ("tie_word_embeddings", bool, "HF's Nemotron-H keeps its own lm_head whatever the config says, "
                      "so a tied config does not describe the checkpoint; allowed: false")),
            random_config=random_config)
