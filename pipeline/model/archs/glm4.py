"""GLM-4 (0414): biased q/k/v, gate/up fused into gate_up_proj, sandwich norms (a norm after attention and after the
MLP as well as before each), partial rotary."""
from pipeline.model.archs import Arch, Mlp, Norms

ARCH = Arch(family="GLM-4", mlp=Mlp(gate_up="gate_up_proj"), norms=Norms(placement="sandwich"),
            rotary="rope, partial (0.5)")
