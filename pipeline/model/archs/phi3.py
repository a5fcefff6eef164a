"""Phi-3 / Phi-4-mini: q/k/v fused into qkv_proj, gate/up into gate_up_proj; partial rotary and longrope scaling (its
long/short switch is a torch.where, so it traces)."""
from pipeline.model.archs import Arch, Attention, Mlp

ARCH = Arch(family="Phi-3 / Phi-4-mini",
            attention=Attention(qkv="qkv_proj", head_dim_key=None),
            mlp=Mlp(gate_up="gate_up_proj"),
            rotary="rope, partial; longrope scaling",
            tiny={"partial_rotary_factor": 0.75, "original_max_position_embeddings": 1024,
                  "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0,
                                      "original_max_position_embeddings": 1024,
                                      "short_factor": [1.0 + i / 20 for i in range(6)],
                                      "long_factor": [2.0 + i / 10 for i in range(6)]}})
