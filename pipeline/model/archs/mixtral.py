"""Mixtral: Llama's attention; a softmax top-k router over stacked experts (gate/up rows then down)."""
from pipeline.model.archs import Arch, Experts

ARCH = Arch(family="Mixtral", experts=Experts(count_key="num_local_experts", width_key="intermediate_size"),
            tiny={"num_local_experts": 8, "num_experts_per_tok": 2})
