"""Qwen3-Next: Qwen3.5's layer pattern (three Gated DeltaNet layers to one gated full-attention layer, norms scaling
by 1 + weight, q/k norms, partial rotary), with the Gated DeltaNet's projections fused per key head (split at load
into Qwen3.5's four) and a mixture of experts whose every token also runs a shared expert, scaled by a sigmoid gate."""
from pipeline.model.archs import Arch, Attention, Experts, GatedDeltaNet, Norms
from pipeline.model.archs.qwen3_5_text import delta_layers
from pipeline.model.archs.qwen3_moe import dense_layers


def random_config(r, common: dict) -> dict:
    """A tiny Qwen3-Next: Qwen3.5's delta_layers; 8 experts (top 2) and a shared expert on every layer but the second,
    which stays dense (both MLP kinds are built)."""
    return dict(delta_layers(r, common),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])


ARCH = Arch(family="Qwen3-Next", attention=Attention(qk_norm="head", output_gate=True), norms=Norms(offset=1.0),
            gated_delta=GatedDeltaNet(fused_qkvz="in_proj_qkvz", fused_ba="in_proj_ba"),
            experts=Experts(dense_layers=dense_layers, shared="shared_expert", shared_gate="shared_expert_gate"),
            rotary="rope, partial", random_config=random_config)
