"""Qwen3-MoE: Qwen3's attention; a softmax top-k router over stacked experts (gate/up rows then down), some layers
dense by mlp_only_layers / decoder_sparse_step."""
from pipeline.model.archs import Arch, Attention, Experts


def dense_layers(config) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if i in (config.mlp_only_layers or [])
            or not (config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0)]


ARCH = Arch(family="Qwen3-MoE", attention=Attention(qk_norm="head"), experts=Experts(dense_layers=dense_layers),
            tiny={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True})
