"""Hunyuan MoE (Hunyuan-A13B): Hunyuan's attention (q/k norms after the rotary, "dynamic" rotary with a fixed alpha);
in every layer a float32 linear router (gate.wg) over stacked experts of intermediate_size, and a shared MLP every
token runs, unscaled."""
from pipeline.model.archs import Arch, Attention, Experts
from pipeline.model.archs.hunyuan_v1_dense import ARCH as DENSE


def _per_layer(value) -> bool:
    return isinstance(value, (list, tuple))


ARCH = Arch(family="Hunyuan MoE", attention=Attention(qk_norm="head"), static_ropes=DENSE.static_ropes,
            experts=Experts(router_linear="wg", count_key="num_experts", top_k_key="moe_topk",
                            width_key="intermediate_size", shared="shared_mlp", shared_width_key="intermediate_size"),
            refuses=DENSE.refuses + tuple((key, _per_layer, "a value per layer: allowed one int for every layer")
                                          for key in ("num_experts", "moe_topk")),
            tiny={"num_experts": 8, "moe_topk": 2})
