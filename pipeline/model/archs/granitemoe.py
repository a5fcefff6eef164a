"""Granite MoE (Granite 3.0 / 3.1 MoE): Granite's multipliers; a top-k router whose chosen logits are softmaxed, over
stacked experts, in every layer (block_sparse_moe)."""
from pipeline.model.archs import Arch, Experts, Mlp

ARCH = Arch(family="Granite MoE", mlp=Mlp(path="block_sparse_moe"), embedding_scale="embedding_multiplier",
            logits="logits_scaling",
            experts=Experts(router="router", count_key="num_local_experts", width_key="intermediate_size"),
            tiny={"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
                  "logits_scaling": 8.0, "num_local_experts": 8, "num_experts_per_tok": 2})
