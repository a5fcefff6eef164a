"""Apertus: an ungated MLP, down(xIELU(up(x))) (xIELU's four scalars per layer are float parameters of the
activation), per-head q/k norms, and its norms named attention_layernorm / feedforward_layernorm."""
from pipeline.model.archs import Arch, Attention, Mlp, Norms

ARCH = Arch(family="Apertus", attention=Attention(qk_norm="head"), mlp=Mlp(gate=None),
            norms=Norms(attention_input="attention_layernorm", mlp_input="feedforward_layernorm"))
