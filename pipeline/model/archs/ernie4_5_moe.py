"""ERNIE 4.5 MoE: ERNIE 4.5's attention (interleaved rotary); a softmax router whose top-k is picked after a per-expert
correction bias (kept in float, in the router), over stacked experts, and shared experts every token runs, unscaled;
MoE layers from moe_layer_start_index to moe_layer_end_index every moe_layer_interval, the others dense."""
from pipeline.model.archs import Arch, Experts


def dense_layers(config) -> list[int]:
    start, end, every = config.moe_layer_start_index, config.moe_layer_end_index, config.moe_layer_interval
    return [i for i in range(config.num_hidden_layers) if not ((i + 1) % every == 0 and start <= i <= end)]


def shared_width(config) -> int:
    return config.moe_intermediate_size * config.moe_num_shared_experts


ARCH = Arch(family="ERNIE 4.5 MoE", rotary="rope, interleaved",
            experts=Experts(dense_layers=dense_layers, shared="shared_experts", shared_width=shared_width),
            tiny={"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
                  "moe_layer_start_index": 1})
