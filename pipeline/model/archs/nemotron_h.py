"""Nemotron-H: a stack of single blocks behind one norm each (`mixer`): Mamba-2 (`M`), attention without rotary
(`*`), an ungated ReLU^2 MLP (`-`), or a mixture of experts (`E`: ungated ReLU^2 experts and a shared one, picked by
a sigmoid router over expert groups with a correction bias, scaled by routed_scaling_factor: HF's router module);
config.json's hybrid_override_pattern spells the stack, which HF reads into layer_types. The Mamba-2 time step has a
floor (time_step_min)."""
from pipeline.model.archs import Arch, Attention, Experts, Mamba2, Mlp, Norms, mamba_layer_kinds


def random_config(r, common: dict) -> dict:
    """A tiny Nemotron-H: Mamba-2, MoE, attention, MLP blocks (8 Mamba heads of 16 over two B/C groups, a state of
    16; 8 experts in 2 groups, top 2 from the best group, and a shared expert), its head untied (as the released
    models)."""
    pattern = ("ME*-" * r.num_hidden_layers)[:r.num_hidden_layers]
    return dict(common, hybrid_override_pattern=pattern, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                ssm_state_size=16, chunk_size=8, time_step_min=0.01, tie_word_embeddings=False, n_routed_experts=8,
                num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=64, routed_scaling_factor=1.5, norm_topk_prob=True)


def dense_layers(config) -> list[int]:
    """Every block but the MoE ones."""
    return [i for i, t in enumerate(config.layers_block_type) if t != "moe"]


ARCH = Arch(family="Nemotron-H", attention=Attention(path="mixer"), mlp=Mlp(path="mixer", gate=None),
            experts=Experts(router="gate", count_key="n_routed_experts", shared="shared_experts",
                            shared_width_key="moe_shared_expert_intermediate_size", layout="ungated",
                            activation="relu2", dense_layers=dense_layers),
            norms=Norms(attention_input="norm", mlp_input="norm"),
            mamba2=Mamba2(path="mixer", heads_key="mamba_num_heads", head_dim_key="mamba_head_dim",
                          groups_key="n_groups", state_key="ssm_state_size", kernel_key="conv_kernel",
                          activation_key="mamba_hidden_act"),
            layers="model.layers", layer_kinds=mamba_layer_kinds, blocks=True, rotary="none (NoPE)",
            refuses=(("moe_latent_size", lambda n: n is not None,
                      "experts over a latent projection (fc1/fc2_latent_proj) are not built yet; allowed: null"),
                     ("mlp_hidden_act", lambda act: act != "relu2",
                      "the experts' kernel runs relu(up)^2 for Nemotron-H: allowed ['relu2']"),
                     ("tie_word_embeddings", bool, "HF's Nemotron-H keeps its own lm_head whatever the config says, "
                      "so a tied config does not describe the checkpoint; allowed: false")),
            random_config=random_config)
