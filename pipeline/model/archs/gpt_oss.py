"""gpt-oss: biased projections, attention sinks (a learned per-head logit in every softmax), alternating sliding and
full layers, yarn rotary, a biased router over biased experts with a clamped SwiGLU (gate and up interleaved). HF has
no sdpa path for its sinks: the float reference runs HF's eager attention."""
from pipeline.model.archs import Arch, Attention, Experts

ARCH = Arch(family="gpt-oss", attention=Attention(sinks="sinks"),
            experts=Experts(router="router", count_key="num_local_experts", width_key="intermediate_size",
                            layout="interleaved", activation="clamped_swiglu"),
            rotary="rope (yarn scaling)", reference_attention="eager",
            tiny={"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 24})
